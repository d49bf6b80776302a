"""GPU out-of-memory classification (migd.core.oom; reference htcondor-mps-nvml.md §6).

The snippets are real-world messages as the frameworks print them (PyTorch, TensorFlow,
JAX, CuPy, Numba, llama.cpp, vLLM), not strings taken from the signature table.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migd.core.oom import (
    SIGNATURES,
    OomPolicy,
    TailBuffer,
    classify_exit,
    find_signatures,
    tried_mib,
)
from migd.errors import ConfigError

TORCH_TRACEBACK = """\
Traceback (most recent call last):
  File "/home/u/train.py", line 88, in <module>
    loss = model(batch).loss
           ^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1553, in _call_impl
    return forward_call(*args, **kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total \
capacity of 9.50 GiB of which 3.06 MiB is free. Including non-PyTorch memory, this process \
has 9.49 GiB memory in use. Of the allocated memory 9.12 GiB is allocated by PyTorch, and \
145.30 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is \
large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.
"""

# (name, stderr, expected signature) -- each a GPU OOM when the job exits non-zero.
GPU_OOM_SNIPPETS = [
    ("pytorch >= 1.13 traceback", TORCH_TRACEBACK, "torch_oom"),
    (
        "pytorch 2.0 torch.cuda.OutOfMemoryError",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.53 GiB (GPU 0; "
        "39.39 GiB total capacity; 36.12 GiB already allocated; 1.14 GiB free)",
        "torch_oom",
    ),
    (
        "pytorch distributed rank prefix",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB.",
        "torch_oom",
    ),
    (
        "pytorch < 1.13",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total "
        "capacity; 12.24 GiB already allocated; 1.63 GiB free; 13.01 GiB reserved in total by "
        "PyTorch)",
        "torch_oom_legacy",
    ),
    ("cuda error via c10", "RuntimeError: CUDA error: out of memory", "cuda_error_oom"),
    (
        "cuda error, torch 2.8 AcceleratorError",
        "torch.AcceleratorError: CUDA error: out of memory\nCUDA kernel errors might be "
        "asynchronously reported at some other API call, so the stacktrace below might be "
        "incorrect.",
        "cuda_error_oom",
    ),
    (
        "cublas",
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cublas_alloc",
    ),
    ("cudnn", "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "cudnn_alloc"),
    (
        "tensorflow",
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: Graph execution error:"
        "\n\nOOM when allocating tensor with shape[256,1024,1024] and type float on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc\n\t "
        "[[{{node model/dense/MatMul}}]]\nHint: If you want to see a list of allocated tensors "
        "when OOM happens, add report_tensor_allocations_upon_oom to RunOptions for current "
        "allocation info.\n [Op:__inference_train_function_1234]",
        "tf_oom",
    ),
    (
        "jax",
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying "
        "to allocate 33762398024 bytes.",
        "xla_oom",
    ),
    (
        "jax bfc",
        "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for 5.41GiB "
        "(5808853401B) on device ordinal 0",
        "xla_oom",
    ),
    (
        "cuda-python driver",
        "cuda.core.experimental._utils.CUDAError: CUDA_ERROR_OUT_OF_MEMORY: out of memory",
        "cuda_oom_code",
    ),
    (
        "cupy runtime",
        "cupy_backends.cuda.api.runtime.CUDARuntimeError: cudaErrorMemoryAllocation: out of memory",
        "cuda_oom_code",
    ),
    (
        "numba",
        "numba.cuda.cudadrv.driver.CudaAPIError: [2] Call to cuMemAlloc results in "
        "CUDA_ERROR_OUT_OF_MEMORY",
        "cuda_oom_code",
    ),
    (
        "llama.cpp",
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 590.07 MiB on device 0: "
        "cudaMalloc failed: out of memory\nllama_model_load: error loading model: unable to "
        "allocate CUDA0 buffer",
        "cudamalloc_failed",
    ),
    (
        "nccl",
        "misc/alloc.h:48 NCCL WARN Cuda failure 'out of memory'",
        "cudamalloc_failed",
    ),
    (
        "vllm",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
        "vllm_no_kv_memory",
    ),
    (
        "exception repr in a log",
        "ERROR worker crashed: OutOfMemoryError('CUDA out of memory. Tried to allocate 1.00 GiB')",
        "torch_oom_message",
    ),
    (
        "structured log value",
        '{"level": "error", "msg": "CUDA out of memory. Tried to allocate 2.00 GiB"}',
        "torch_oom_message",
    ),
    (
        "colours and an apostrophe",
        "\x1b[31mcan't continue:\x1b[0m RuntimeError: CUDA error: out of memory",
        "cuda_error_oom",
    ),
    (
        "tqdm redraws",
        "epoch 1:  40%|████      | 40/100\repoch 1:  41%|████      | 41/100\r"
        "RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB",
        "torch_oom_legacy",
    ),
]


@pytest.mark.parametrize(
    ("exit_code", "signal"),
    [(1, None), (2, None), (120, None), (134, None), (None, 6), (-6, None), (1, 0)],
    ids=["exit1", "exit2", "exit120", "exit134-abort", "SIGABRT", "popen-abort", "exit1-sig0"],
)
@pytest.mark.parametrize(
    ("snippet", "signature"),
    [(s, sig) for _, s, sig in GPU_OOM_SNIPPETS],
    ids=[name for name, _, _ in GPU_OOM_SNIPPETS],
)
def test_gpu_oom_signatures_with_nonzero_exit_are_strong(
    snippet: str, signature: str, exit_code: int | None, signal: int | None
) -> None:
    verdict = classify_exit(exit_code, signal, snippet, None, None)
    assert verdict.kind == "strong", verdict.reason
    assert verdict.signature == signature
    assert verdict.is_oom
    # bytes work the same as text
    assert classify_exit(exit_code, signal, snippet.encode(), None, None).kind == "strong"


@pytest.mark.parametrize(
    "snippet", [s for _, s, _ in GPU_OOM_SNIPPETS], ids=[n for n, _, _ in GPU_OOM_SNIPPETS]
)
def test_exit_zero_is_never_an_oom(snippet: str) -> None:
    """Frameworks catch OOM and retry smaller (batch-size finders): exit 0 is success."""
    verdict = classify_exit(0, None, snippet, 9900, 9984)
    assert verdict.kind == "none"
    assert "exited 0" in verdict.reason


@pytest.mark.parametrize(
    ("exit_code", "signal"),
    [(137, None), (None, 9), (-9, None), (143, None), (None, 15), (130, None), (None, 24)],
    ids=["exit137", "SIGKILL", "popen-kill", "exit143", "SIGTERM", "exit130-INT", "SIGXCPU"],
)
def test_kills_from_outside_are_not_gpu_oom(exit_code: int | None, signal: int | None) -> None:
    """Host-RAM OOM killer, HTCondor removal: HTCondor handles those, not migd."""
    verdict = classify_exit(exit_code, signal, TORCH_TRACEBACK + "Killed\n", 9984, 9984)
    assert verdict.kind == "none"
    assert "not a GPU OOM" in verdict.reason


@pytest.mark.parametrize(
    "stderr",
    [
        "./run.sh: line 3: 12345 Killed                  python train.py",
        "Killed",
        "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.",
        "MemoryError",
        "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 74.5 GiB for an array "
        "with shape (100000, 100000) and data type float64",
        "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  "
        "std::bad_alloc",
        "OSError: [Errno 12] Cannot allocate memory",
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating "
        "tensor with shape[100000,100000] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu",
    ],
    ids=["bash-killed", "killed", "dataloader", "MemoryError", "numpy", "bad_alloc", "ENOMEM",
         "tf-cpu"],
)  # fmt: skip
def test_host_memory_exhaustion_is_not_gpu_oom(stderr: str) -> None:
    verdict = classify_exit(1, None, stderr, 9700, 9984)
    assert verdict.kind == "none"
    assert "host memory" in verdict.reason


@pytest.mark.parametrize(
    "stderr",
    [
        "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable",
        "torch.AcceleratorError: CUDA error: CUDA-capable device(s) is/are busy or unavailable",
        "tensorflow.python.framework.errors_impl.InternalError: cudaSetDevice() on GPU:0 failed. "
        "Status: CUDA-capable device(s) is/are busy or unavailable",
        "cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable",
        "cudaErrorMpsConnectionFailed: MPS client failed to connect to the MPS control daemon or "
        "the MPS server",
        "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
    ],
)
def test_device_unavailable_is_its_own_kind(stderr: str) -> None:
    verdict = classify_exit(1, None, stderr, 10, 9984)
    assert verdict.kind == "mps_unavailable"
    assert not verdict.is_oom


def test_mentions_of_the_message_are_not_the_message() -> None:
    cases = [
        # bash -x trace of a grep
        '+ grep -q "CUDA out of memory" /tmp/job.log\nValueError: bad config',
        # a grep echoed by a script without quotes
        "running: grep CUDA out of memory. Tried to allocate log.txt\nexit",
        # a source line quoted by a Python traceback
        'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n'
        '    if "CUDA out of memory" in str(err): retry()\nValueError: nope',
        # a string in a print of code, not after ':' or '='
        "hint: look for print('RuntimeError: CUDA out of memory') in your logs",
    ]
    for stderr in cases:
        verdict = classify_exit(1, None, stderr, 100, 9984)
        assert verdict.kind == "none", (stderr, verdict)
        assert find_signatures(stderr) == []


HANDLED_OOM_THEN_VALUE_ERROR = (
    "batch 512: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
    "retrying with batch 256\n"
    "Traceback (most recent call last):\n"
    '  File "t.py", line 9, in <module>\n'
    "ValueError: shapes (256, 3) and (512, 3) not aligned\n"
)


@pytest.mark.parametrize(
    ("peak", "limit", "kind"),
    [
        (None, None, "none"),  # peak unknown: the job died of the ValueError
        (500, 9984, "none"),  # memory was nowhere near the limit
        (8900, 9984, "none"),  # 89%
        (8986, 9984, "weak"),  # 90%: memory was at the limit, one bigger try
        (9984, 9984, "weak"),
    ],
)
def test_handled_oom_followed_by_another_fatal_error_needs_high_usage(
    peak: int | None, limit: int | None, kind: str
) -> None:
    verdict = classify_exit(1, None, HANDLED_OOM_THEN_VALUE_ERROR, peak, limit)
    assert verdict.kind == kind, verdict.reason
    assert "ValueError" in verdict.reason
    assert verdict.signature == "torch_oom"


@pytest.mark.parametrize(
    "bad",
    [
        {"weak_fraction": 0.0},
        {"weak_fraction": 1.5},
        {"corroborate_fraction": -0.1},
        {"weak_retries": -1},
        {"weak_retries": 1.5},
    ],
)
def test_oom_policy_rejects_bad_thresholds(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="oom\\."):
        OomPolicy(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "after",
    [
        "\nDuring handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n"
        "AttributeError: 'NoneType' object has no attribute 'x'",
        "\nThe above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n"
        "lightning.fabric.utilities.exceptions.MisconfigurationException: x",
        "\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\ntrain.py FAILED",
        "\nsubprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero "
        "exit status 1.",
    ],
    ids=["during-handling", "direct-cause", "torchrun", "accelerate"],
)  # fmt: skip
def test_oom_chained_or_propagated_by_a_launcher_stays_strong(after: str) -> None:
    verdict = classify_exit(1, None, TORCH_TRACEBACK + after, None, None)
    assert verdict.kind == "strong", verdict.reason


def test_the_last_signature_decides() -> None:
    busy_then_oom = (
        "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable\n"
        "retrying...\nRuntimeError: CUDA error: out of memory\n"
    )
    assert classify_exit(1, None, busy_then_oom, None, None).kind == "strong"
    oom_then_busy = (
        "RuntimeError: CUDA error: out of memory\n"
        "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable\n"
    )
    assert classify_exit(1, None, oom_then_busy, None, None).kind == "mps_unavailable"


@pytest.mark.parametrize(
    ("peak", "limit", "kind"),
    [
        (9800, 9984, "weak"),  # 98.2%
        (9685, 9984, "weak"),  # 97.0%
        (9684, 9984, "none"),  # 96.99%
        (5000, 9984, "none"),
        (None, 9984, "none"),
        (9984, None, "none"),
        (9984, 0, "none"),
    ],
)
def test_weak_needs_high_peak_usage_without_a_signature(
    peak: int | None, limit: int | None, kind: str
) -> None:
    verdict = classify_exit(1, None, "Segmentation fault (core dumped)", peak, limit)
    assert verdict.kind == kind


def test_weak_fraction_is_configurable() -> None:
    policy = OomPolicy(weak_fraction=0.9)
    assert classify_exit(1, None, "", 9000, 9984, policy=policy).kind == "weak"
    assert classify_exit(1, None, "", 9000, 9984).kind == "none"


@pytest.mark.parametrize(
    "stderr",
    [
        "RuntimeError: cuDNN error: CUDNN_STATUS_NOT_INITIALIZED",
        "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling "
        "`cublasCreate(handle)`",
        "W tensorflow/core/common_runtime/bfc_allocator.cc:290] Allocator (GPU_0_bfc) ran out of "
        "memory trying to allocate 2.00GiB with freed_by_count=0.",
    ],
)  # fmt: skip
def test_ambiguous_signatures_need_corroboration(stderr: str) -> None:
    assert classify_exit(1, None, stderr, 9500, 9984).kind == "strong"  # 95% >= 90%
    assert classify_exit(1, None, stderr, 3000, 9984).kind == "weak"
    assert classify_exit(1, None, stderr, None, None).kind == "weak"


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("Tried to allocate 20.00 MiB. GPU 0", 20.0),
        ("Tried to allocate 1.53 GiB (GPU 0;", 1.53 * 1024),
        ("Out of memory while trying to allocate 17179869184 bytes.", 16384.0),
        ("Failed to allocate request for 5.41GiB (5808853401B)", 5.41 * 1024),
        ("Out of memory allocating 4,294,967,296 bytes", 4096.0),
        ("allocating 590.07 MiB on device 0", 590.07),
        ("CUDA error: out of memory", None),
    ],
)
def test_tried_allocation_is_parsed(text: str, mib: float | None) -> None:
    assert tried_mib(text) == (pytest.approx(mib) if mib is not None else None)


def test_verdict_reports_the_failed_allocation_and_usage() -> None:
    verdict = classify_exit(1, None, TORCH_TRACEBACK, 9700, 9984)
    assert verdict.tried_mib == pytest.approx(20.0)
    # The message's "9.49 GiB memory in use" is above the sampled 9700 MiB: the peak is
    # at least what the job said it held (issue 21 §5; was the sampled figure alone).
    assert verdict.held_mib == pytest.approx(9.49 * 1024)
    assert verdict.peak_fraction == pytest.approx(9.49 * 1024 / 9984)
    assert verdict.matched is not None and verdict.matched.startswith("torch.OutOfMemoryError")
    assert verdict.to_dict()["kind"] == "strong"


def test_no_exit_status_is_not_an_oom() -> None:
    assert classify_exit(None, None, TORCH_TRACEBACK, 9984, 9984).kind == "none"


def test_every_signature_documents_a_source_and_recognises_its_example() -> None:
    names = [s.name for s in SIGNATURES]
    assert len(names) == len(set(names))
    for signature in SIGNATURES:
        assert signature.source
        found = find_signatures(signature.example)
        assert [m.signature.name for m in found] == [signature.name]


@given(
    exit_code=st.one_of(st.none(), st.integers(-300, 300)),
    signal=st.one_of(st.none(), st.integers(0, 64)),
    tail=st.one_of(st.binary(max_size=2000), st.text(max_size=2000)),
    peak=st.one_of(st.none(), st.integers(-(10**6), 10**7)),
    limit=st.one_of(st.none(), st.integers(-(10**6), 10**7)),
    oom=st.sampled_from([s for _, s, _ in GPU_OOM_SNIPPETS]),
)
@settings(max_examples=200, deadline=None)
def test_classification_is_total_and_respects_exit_status(
    exit_code: int | None,
    signal: int | None,
    tail: bytes | str,
    peak: int | None,
    limit: int | None,
    oom: str,
) -> None:
    if isinstance(tail, bytes):
        tail += b"\n" + oom.encode()
    else:
        tail += "\n" + oom
    verdict = classify_exit(exit_code, signal, tail, peak, limit)
    assert verdict.kind in ("strong", "weak", "none", "mps_unavailable")
    if exit_code in (None, 0) and not signal:
        assert verdict.kind == "none"
    killed = signal in (9, 15) or exit_code in (137, 143, -9, -15)
    if killed:
        assert verdict.kind == "none"


# -- TailBuffer -----------------------------------------------------------------------------


@given(st.integers(1, 300), st.lists(st.binary(max_size=500), max_size=40))
@settings(max_examples=200, deadline=None)
def test_tail_buffer_keeps_exactly_the_last_bytes(max_bytes: int, chunks: list[bytes]) -> None:
    tail = TailBuffer(max_bytes)
    for chunk in chunks:
        tail.feed(chunk)
    everything = b"".join(chunks)
    assert tail.data == everything[-max_bytes:]
    assert len(tail) == len(tail.data)
    assert tail.total_bytes == len(everything)
    assert tail.truncated == (len(everything) > max_bytes)


def test_tail_buffer_text_drops_a_cut_utf8_sequence() -> None:
    tail = TailBuffer(4)
    tail.feed("xé—".encode())  # 1 + 2 + 3 bytes: keeping 4 cuts "é" in half
    assert tail.data == "é".encode()[1:] + "—".encode()
    assert tail.text() == "—"
    tail.feed(memoryview(b"ab"))
    assert tail.data == "—".encode()[1:] + b"ab"
    assert tail.text() == "ab"


def test_tail_buffer_feeds_the_classifier() -> None:
    tail = TailBuffer(4096)
    for _ in range(1000):
        tail.feed(b"step 1234: loss 0.123\n")
    tail.feed(TORCH_TRACEBACK.encode())
    assert tail.truncated
    assert classify_exit(1, None, tail.data, None, None).kind == "strong"
    tail.clear()
    assert tail.data == b"" and tail.total_bytes == 0


@pytest.mark.parametrize("size", [0, -1])
def test_tail_buffer_rejects_non_positive_sizes(size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        TailBuffer(size)


def test_traceback_without_source_line_still_counts() -> None:
    """``python -c`` and .pyc-only jobs print no source line under ``File ...``."""
    tail = (
        "Traceback (most recent call last):\n"
        '  File "<string>", line 1, in <module>\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. "
        "GPU 0 has a total capacity of 4.75 GiB\n"
    )
    verdict = classify_exit(1, None, tail, 4096, 4864)
    assert verdict.kind == "strong" and verdict.tried_mib == 1024.0


@pytest.mark.parametrize(
    ("line", "held"),
    [
        # PyTorch 2.x: in use (non-PyTorch memory included) beats allocated + cached.
        (TORCH_TRACEBACK.splitlines()[5] + " " + " ".join(TORCH_TRACEBACK.splitlines()[6:9]),
         9.49 * 1024),
        # PyTorch 1.x: reserved in total beats already allocated.
        ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 9.75 GiB total "
         "capacity; 7.12 GiB already allocated; 1.02 GiB free; 7.80 GiB reserved in total by "
         "PyTorch)", 7.80 * 1024),
        # The simulated job's message: allocated by PyTorch only.
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a "
         "total capacity of 4.75 GiB of which 1792.00 MiB is free. Of the allocated memory "
         "3072.00 MiB is allocated by PyTorch.", 3072.0),
        ("Of the allocated memory 1.00 GiB is allocated by PyTorch, and 512.00 MiB is reserved "
         "by PyTorch but unallocated.", 1536.0),
        ("XLA: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.",
         None),
    ],
)  # fmt: skip
def test_what_the_job_held_at_the_failure(line: str, held: float | None) -> None:
    from migd.core.oom import held_mib

    assert held_mib(line) == (pytest.approx(held) if held is not None else None)


def test_an_oom_with_figures_never_says_peak_unknown() -> None:
    """Issue 21 §5: the attempt that ran out of memory at 4096 MiB recorded "peak unknown"."""
    tail = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has "
        "a total capacity of 4.75 GiB of which 1792.00 MiB is free. Of the allocated memory "
        "3072.00 MiB is allocated by PyTorch.\n"
    )
    verdict = classify_exit(1, None, tail, None, 4864)
    assert verdict.kind == "strong"
    assert "peak unknown" not in verdict.reason and "peak >= 3072 of 4864 MiB" in verdict.reason
    assert verdict.held_mib == 3072 and verdict.tried_mib == 1024
    assert verdict.to_dict()["held_mib"] == 3072
    # A sampled peak above the message's figure stands.
    assert classify_exit(1, None, tail, 4000, 4864).reason.endswith("peak 4000 of 4864 MiB")
    # Without figures nothing is invented.
    bare = classify_exit(1, None, "RuntimeError: CUDA error: out of memory\n", None, 4864)
    assert bare.held_mib is None and "peak unknown" in bare.reason
