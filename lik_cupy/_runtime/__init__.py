"""The GPU runtime: NVRTC compilation and kernel caches (``nvrtc``), the forward launch
(``launch``) and its operands (``operands``), on-device value checks (``device_checks``), Hopper
tensor maps (``tma``), token-split scratch (``token_split``), page-locked host memory
(``pinned``), the INT8 quantiser (``quantize``) and ``warmup``. Devices, allocations, caches and
environment variables are its base, ``lik_cupy._base``."""
