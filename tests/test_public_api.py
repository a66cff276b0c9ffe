"""The public API, frozen: every public module's ``__all__`` and the signature of each public
function. A change here is a change users see: make it on purpose.

Read from the source with ``ast``, so ``lik_cupy.torch`` and ``lik_cupy.jax`` are covered
without torch or jax installed.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

from lik_command import installed

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lik_cupy"

# module -> (sorted __all__, {public function: its parameters})
FROZEN = {'lik_cupy': (['CompileError',
               'Corpus',
               'DeviceMemoryError',
               'LikError',
               'PinnedHost',
               'PlaidIndex',
               'ShardError',
               '__version__',
               'dequantize_fp8',
               'dequantize_int8',
               'get_precision',
               'gpu_available',
               'maxsim',
               'maxsim_backward',
               'maxsim_fp8',
               'maxsim_fp8_varlen',
               'maxsim_from_hidden',
               'maxsim_from_hidden_backward',
               'maxsim_int8',
               'maxsim_int8_varlen',
               'maxsim_pairs',
               'maxsim_residual',
               'maxsim_residual_varlen',
               'maxsim_varlen',
               'pin_host',
               'quantize_fp8',
               'quantize_int8',
               'retrieve',
               'set_precision',
               'warmup'],
              {}),
 'lik_cupy.backward': (['maxsim_backward'],
                       {'maxsim_backward': "(grad_scores, Q, D, argmax, *, d_offsets=None, method='auto', "
                                           "validate=None, backend='auto')"}),
 'lik_cupy.cli': (['EXIT_BAD_INPUT', 'EXIT_INTERRUPTED', 'main', 'run_score'],
                  {'main': '()',
                   'run_score': '(queries: str, docs, out: str, *, q_lengths: str | None=None, d_lengths=(), top_k: '
                                'int=10, full_matrix: bool=False, check: bool=False, cpu: bool=False, device: int | '
                                'None=None, devices: str | None=None, bf16_bits: bool=False, scheduler: str | '
                                'None=None)'}),
 'lik_cupy.corpus': (['Corpus'], {}),
 'lik_cupy.distributed': (['DistributedCorpus'], {}),
 'lik_cupy.errors': (['CompileError', 'DeviceMemoryError', 'LikError', 'ShardError'], {}),
 'lik_cupy.forward': (['maxsim', 'maxsim_pairs', 'maxsim_varlen'],
                      {'maxsim': '(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, '
                                 "return_argmax=False, backend='auto', precision=None, validate=None)",
                       'maxsim_pairs': '(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, '
                                       "return_argmax=False, backend='auto', precision=None, validate=None)",
                       'maxsim_varlen': '(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, q_offsets=None, '
                                        "return_argmax=False, validate_offsets=True, backend='auto', precision=None, "
                                        'validate=None)'}),
 'lik_cupy.fp8': (['maxsim_fp8', 'maxsim_fp8_varlen'],
                  {'maxsim_fp8': '(Q, D, d_scales, q_mask=None, d_mask=None, *, q_scales=None, q_lengths=None, '
                                 "d_lengths=None, return_argmax=False, backend='auto', validate=None)",
                   'maxsim_fp8_varlen': '(Q, D_tokens, d_scales, d_offsets, q_mask=None, *, q_scales=None, '
                                        "q_lengths=None, return_argmax=False, validate_offsets=True, backend='auto', "
                                        'validate=None)'}),
 'lik_cupy.int8': (['maxsim_int8', 'maxsim_int8_varlen'],
                   {'maxsim_int8': '(Q, D, d_scales, q_mask=None, d_mask=None, *, q_scales=None, q_lengths=None, '
                                   "d_lengths=None, return_argmax=False, backend='auto', validate=None)",
                    'maxsim_int8_varlen': '(Q, D_tokens, d_scales, d_offsets, q_mask=None, *, q_scales=None, '
                                          "q_lengths=None, return_argmax=False, validate_offsets=True, backend='auto', "
                                          'validate=None)'}),
 'lik_cupy.integrations': ([], {}),
 'lik_cupy.integrations.colpali': (['maxsim_inbatch',
                                    'maxsim_kd',
                                    'patch_colpali_engine',
                                    'score_multi_vector',
                                    'unpatch_colpali_engine'],
                                   {'maxsim_inbatch': '(query, doc)',
                                    'maxsim_kd': '(query, doc)',
                                    'patch_colpali_engine': '()',
                                    'score_multi_vector': '(qs, ps, batch_size: int=128, device=None)',
                                    'unpatch_colpali_engine': '()'}),
 'lik_cupy.integrations.pylate': (['ColBERTScores',
                                   'colbert_kd_scores',
                                   'colbert_scores',
                                   'colbert_scores_pairwise',
                                   'patch_pylate',
                                   'unpatch_pylate'],
                                  {'colbert_kd_scores': '(queries_embeddings, documents_embeddings, queries_mask=None, '
                                                        'documents_mask=None, backend=None)',
                                   'colbert_scores': '(queries_embeddings, documents_embeddings, queries_mask=None, '
                                                     'documents_mask=None, backend=None)',
                                   'colbert_scores_pairwise': '(queries_embeddings, documents_embeddings, '
                                                              'backend=None)',
                                   'patch_pylate': '()',
                                   'unpatch_pylate': '()'}),
 'lik_cupy.fused_head': (['CHUNK_BYTES', 'maxsim_from_hidden', 'maxsim_from_hidden_backward'],
                         {'maxsim_from_hidden': '(Q, H, W, bias=None, q_mask=None, d_mask=None, *, q_lengths=None, '
                                                'd_lengths=None, normalize=True, eps=1e-12, return_argmax=False, '
                                                "max_chunk_bytes=None, backend='auto', precision=None, validate=None)",
                          'maxsim_from_hidden_backward': '(grad_scores, Q, H, W, bias, argmax, d_mask=None, *, '
                                                         'd_lengths=None, normalize=True, eps=1e-12, '
                                                         "max_chunk_bytes=None, backend='auto', precision=None, "
                                                         'validate=None)'}),
 'lik_cupy.jax': (['maxsim', 'maxsim_from_hidden', 'maxsim_int8', 'maxsim_int8_varlen', 'maxsim_varlen'],
                  {'maxsim': "(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, method='auto', "
                             "precision=None, backend='auto')",
                   'maxsim_from_hidden': '(Q, H, W, bias=None, q_mask=None, d_mask=None, *, q_lengths=None, '
                                         'd_lengths=None, normalize=True, eps=1e-12, max_chunk_bytes=None, '
                                         "precision=None, backend='auto')",
                   'maxsim_int8': '(Q, D, d_scales, q_mask=None, d_mask=None, *, q_scales=None, q_lengths=None, '
                                  "d_lengths=None, backend='auto')",
                   'maxsim_int8_varlen': '(Q, D_tokens, d_scales, d_offsets, q_mask=None, *, q_scales=None, '
                                         "q_lengths=None, backend='auto')",
                   'maxsim_varlen': "(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, method='auto', "
                                    "precision=None, backend='auto')"}),
 'lik_cupy.plaid': (['PlaidIndex', 'decompress_residuals', 'maxsim_residual', 'maxsim_residual_varlen'],
                    {'decompress_residuals': '(codes, residuals, centroids, bucket_weights, nbits, *, normalize=True)',
                     'maxsim_residual': '(Q, codes, residuals, d_lengths, centroids, bucket_weights, nbits, '
                                        'q_mask=None, *, q_lengths=None, normalize=True, return_argmax=False, '
                                        "backend='auto')",
                     'maxsim_residual_varlen': '(Q, codes, residuals, d_offsets, centroids, bucket_weights, nbits, '
                                               'q_mask=None, *, q_lengths=None, candidates=None, normalize=True, '
                                               "return_argmax=False, validate=True, backend='auto')"}),
 'lik_cupy.precision': (['PRECISIONS', 'get_precision', 'set_precision'],
                        {'get_precision': '()', 'set_precision': '(precision: str | None)'}),
 'lik_cupy.quantize': (['dequantize_fp8', 'dequantize_int8', 'quantize_fp8', 'quantize_int8'],
                       {'dequantize_fp8': "(X_fp8, scales, *, backend='auto')",
                        'dequantize_int8': "(X_int8, scales, *, backend='auto')",
                        'quantize_fp8': "(X, *, per='token', backend='auto')",
                        'quantize_int8': "(X, *, backend='auto')"}),
 'lik_cupy.retrieval': (['MAX_K', 'retrieve'],
                       {'retrieve': '(Q, D, k, q_mask=None, *, q_lengths=None, q_scales=None, d_offsets=None, '
                                    "d_mask=None, d_lengths=None, d_scales=None, max_gpu_bytes=None, backend='auto', "
                                    'precision=None)'}),
 'lik_cupy.serving': (['Batcher', 'DeadlineExceeded', 'OPERATIONS', 'Observer', 'Overloaded', 'ShuttingDown'], {}),
 'lik_cupy.serving.batcher': (['Batcher', 'OPERATIONS', 'Observer'], {}),
 'lik_cupy.serving.errors': (['DeadlineExceeded', 'Overloaded', 'ShuttingDown'], {}),
 'lik_cupy.serving.grpc': (['start_server'], {}),
 'lik_cupy.serving.http': (['MODELS', 'make_app', 'run', 'run_processes', 'serve'],
                           {'make_app': '(load, *, max_body_bytes: int=MAX_BODY, grpc_address: str | None=None, '
                                        'header_timeout: float=HEADER_TIMEOUT_S, body_timeout: float=BODY_TIMEOUT_S, '
                                        'body_min_rate: int=BODY_MIN_RATE, grpc_max_streams: int=GRPC_MAX_STREAMS, '
                                        'max_connections: int=MAX_CONNECTIONS, grpc_max_calls: int=GRPC_MAX_CALLS)',
                            'run': "(app, *, host: str='127.0.0.1', port: int=8000)",
                            'run_processes': "(load, processes: int, *, host: str='127.0.0.1', port: int=8000, "
                                             "grpc_port: int | None=None, header_timeout: float=HEADER_TIMEOUT_S, "
                                             "body_timeout: float=BODY_TIMEOUT_S, body_min_rate: int=BODY_MIN_RATE, "
                                             "grpc_max_streams: int=GRPC_MAX_STREAMS, max_connections: "
                                             "int=MAX_CONNECTIONS, grpc_max_calls: int=GRPC_MAX_CALLS)",
                            'serve': "(paths, *, host: str='127.0.0.1', port: int=8000, grpc_port: int | None=None, "
                                     "devices=None, partition: bool | None=None, max_batch: int=64, max_tokens: int=65536, "
                                     "max_delay_us: int=0, max_queue: int=1024, processes: int=1, header_timeout: "
                                     "float=HEADER_TIMEOUT_S, body_timeout: float=BODY_TIMEOUT_S, body_min_rate: "
                                     "int=BODY_MIN_RATE, grpc_max_streams: int=GRPC_MAX_STREAMS, max_connections: "
                                     "int | None=None, grpc_max_calls: int | None=None, client=None, "
                                     "cluster_timeout: float | None=None)"}),
 'lik_cupy.shards': (['CHUNK_BYTES',
                      'NORM_TOLERANCE',
                      'Shard',
                      'ShardError',
                      'VERSION',
                      'ValueScan',
                      'check_finite',
                      'open_input',
                      'open_shard',
                      'pack',
                      'pack_arrays',
                      'scan_values',
                      'write_shard'],
                     {'check_finite': '(shard: Shard, max_bytes: int=CHUNK_BYTES)',
                      'open_input': '(path: str | os.PathLike, lengths: str | os.PathLike | None=None, *, bf16_bits: '
                                    'bool=False)',
                      'open_shard': '(path: str | os.PathLike)',
                      'pack': '(source: Shard, path: str | os.PathLike, *, ids=None, model: str | None=None, dtype: '
                              'str | None=None, overwrite: bool=False, check_finite: bool=False, max_bytes: '
                              'int=CHUNK_BYTES)',
                      'pack_arrays': '(docs: Sequence, path: str | os.PathLike, *, ids=None, model: str | None=None, '
                                     'dtype: str | None=None, overwrite: bool=False, check_finite: bool=False, '
                                     'bf16_bits: bool=False)',
                      'scan_values': '(shard: Shard, max_bytes: int=CHUNK_BYTES)',
                      'write_shard': '(path: str | os.PathLike, tokens: np.ndarray, offsets, *, ids=None, model: str | '
                                     'None=None, dtype: str | None=None, overwrite: bool=False, check_finite: '
                                     'bool=False, scales: np.ndarray | None=None)'}),
 'lik_cupy.torch': (['maxsim', 'maxsim_from_hidden', 'maxsim_varlen'],
                    {'maxsim': "(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, method='auto', "
                               'return_argmax=False, precision=None)',
                     'maxsim_from_hidden': '(Q, H, W, bias=None, q_mask=None, d_mask=None, *, q_lengths=None, '
                                           'd_lengths=None, normalize=True, eps=1e-12, return_argmax=False, '
                                           'max_chunk_bytes=None, precision=None)',
                     'maxsim_varlen': "(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, method='auto', "
                                      'return_argmax=False, precision=None)'})}

# The public subpackages; every other package under lik_cupy/ is private (underscored).
SUBPACKAGES = ("integrations", "serving")


def _module_file(mod: str) -> pathlib.Path:
    parts = mod.split(".")[1:]
    if not parts:
        return PACKAGE / "__init__.py"
    if len(parts) == 1 and parts[0] in SUBPACKAGES:
        return PACKAGE / parts[0] / "__init__.py"
    return PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py")


def _read(mod: str):
    tree = ast.parse(_module_file(mod).read_text())
    names = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = ast.literal_eval(node.value)
    assert names is not None, f"{mod} has no __all__"
    sigs = {n.name: "(" + ast.unparse(n.args) + ")" for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name in names}
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return sorted(names), sigs, defined


def test_the_public_modules_are_the_frozen_ones():
    public = {"lik_cupy"} | {f"lik_cupy.{p.stem}" for p in PACKAGE.glob("*.py") if not p.name.startswith("_")}
    for sub in SUBPACKAGES:
        public |= {f"lik_cupy.{sub}"} | {f"lik_cupy.{sub}.{p.stem}" for p in (PACKAGE / sub).glob("*.py")
                                         if not p.name.startswith("_")}
    assert public == set(FROZEN)


@pytest.mark.parametrize("mod", sorted(FROZEN))
def test_names_and_signatures_are_frozen(mod):
    names, sigs, _ = _read(mod)
    assert (names, sigs) == FROZEN[mod]


@pytest.mark.parametrize("mod", sorted(FROZEN))
def test_every_other_module_level_name_has_an_underscore(mod):
    names, _, defined = _read(mod)
    stray = sorted(n for n in defined - set(names) if not n.startswith("_"))
    assert not stray, f"{mod}: public-looking names outside __all__: {stray}"


def test_internals_live_in_underscored_packages():
    for p in PACKAGE.iterdir():
        if p.is_dir() and (p / "__init__.py").exists() and p.name not in SUBPACKAGES:
            assert p.name.startswith("_"), f"lik_cupy/{p.name}/ is a package without an underscore"


def test_public_names_resolve_and_keep_torch_jax_and_dask_out():
    code = ("import sys, lik_cupy; [getattr(lik_cupy, n) for n in lik_cupy.__all__]; "
            "import lik_cupy.cli, lik_cupy.shards, lik_cupy.errors, lik_cupy.integrations, lik_cupy.serving; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy', 'dask', 'distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_public_name_of_shards_is_documented():
    # The API table's row of the module (docs/api.md), or its docstring (the format's specification).
    import lik_cupy.shards

    api = (PACKAGE.parent / "docs" / "api.md").read_text()
    row = next(line for line in api.splitlines() if line.startswith("| `lik_cupy.shards`"))
    documented = set(re.findall(r"`(\w+)`", row))
    documented |= {n for pair in re.findall(r"``(\w+)``|:\w+:`(\w+)`", lik_cupy.shards.__doc__) for n in pair}
    documented |= {"ShardError"}  # re-exported from lik_cupy.errors, documented there
    assert sorted(set(lik_cupy.shards.__all__) - documented) == []


def test_no_public_module_shares_a_name_with_a_public_function():
    # A submodule's import binds it as an attribute of its package: `lik_cupy.retrieve` the module
    # would hide `lik_cupy.retrieve` the function once anything imported it.
    import lik_cupy

    functions = set(lik_cupy.__all__) | {n for names, _ in FROZEN.values() for n in names}
    clashes = sorted(m for m in FROZEN if m.rsplit(".", 1)[-1] in functions)
    assert not clashes, f"modules named like a public function: {clashes}"


def test_no_public_name_is_a_module_once_every_module_is_imported():
    extras = {"lik_cupy.serving.http": ("starlette", "uvicorn", "prometheus_client"),  # (where their extras are installed)
              "lik_cupy.serving.grpc": ("starlette", "uvicorn", "prometheus_client", "grpc", "tritonclient.grpc")}
    mods = sorted(m for m in FROZEN if m not in ("lik_cupy.torch", "lik_cupy.jax", "lik_cupy.distributed")
                  and not m.startswith("lik_cupy.integrations.")
                  and installed(*extras.get(m, ())))
    code = (f"import importlib, types, lik_cupy\n[importlib.import_module(m) for m in {mods!r}]\n"
            "print(sorted(n for n in lik_cupy.__all__ if isinstance(getattr(lik_cupy, n), types.ModuleType)), "
            "lik_cupy.retrieve is lik_cupy.retrieval.retrieve)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[] True", r.stderr


def test_unknown_attributes_raise():
    import lik_cupy

    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        lik_cupy.nonesuch  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'dispatch'"):
        lik_cupy.dispatch  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from lik_cupy.errors import ShardError
        from lik_cupy.shards import ShardError as again
    assert ShardError is again
