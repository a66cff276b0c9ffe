// The element types of the forward kernels, one traits specialisation per LIK_ELEM: the device
// side of the rows in lik_cupy/_dispatch/elements.py. Every kernel rule that depends on the
// element type reads a trait here rather than testing LIK_ELEM.
//   T        a tile element as stored (16-bit floats as their bit patterns)
//   Acc      the mma / wgmma accumulator
//   kK       elements of K one mma takes: 32 bytes of K (TF32's 8 floats are 32 bytes too)
//   kScaled  each token carries a float32 scale, staged beside its document tile; a similarity
//            is the dot product times the document token's scale, and a row's max is multiplied
//            by its query token's scale
//   kInt     integer accumulators, converted to float before the document token's scale
//   kTf32    float32 tiles that the tensor cores read as TF32 (mma.sync fragments by scalar loads)
// The constants are enumerators: NVRTC emits a static constexpr data member of every instantiated
// class into the module as device data, used or not.
#pragma once

template <int ELEM>
struct Elem;
template <>
struct Elem<0> {  // float16
    typedef u16 T;
    typedef float Acc;
    enum : int { kK = 16 };
    enum : bool { kScaled = false, kInt = false, kTf32 = false };
};
template <>
struct Elem<1> {  // bfloat16
    typedef u16 T;
    typedef float Acc;
    enum : int { kK = 16 };
    enum : bool { kScaled = false, kInt = false, kTf32 = false };
};
template <>
struct Elem<2> {  // float32 on TF32 tensor cores
    typedef float T;
    typedef float Acc;
    enum : int { kK = 8 };
    enum : bool { kScaled = false, kInt = false, kTf32 = true };
};
template <>
struct Elem<3> {  // INT8 with per-token scales
    typedef i8 T;
    typedef int Acc;
    enum : int { kK = 32 };
    enum : bool { kScaled = true, kInt = true, kTf32 = false };
};
template <>
struct Elem<4> {  // FP8 e4m3 (float8_e4m3fn bit patterns) with per-token scales, sm_89+
    typedef u8 T;
    typedef float Acc;
    enum : int { kK = 32 };
    enum : bool { kScaled = true, kInt = false, kTf32 = false };
};
