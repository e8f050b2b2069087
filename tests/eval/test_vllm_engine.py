"""The vLLM engine's plumbing that runs without vLLM: the one line a refusal becomes."""

from quantkit.eval.vllm_engine import _root_cause


def test_a_refusal_names_the_engine_cores_exception_not_the_wrapper():
    stderr = "\n".join([
        "INFO 12-05 02:00:01 [core.py:90] Initializing a V1 LLM engine",
        "(EngineCore_DP0 pid=4242) Traceback (most recent call last):",
        "(EngineCore_DP0 pid=4242) ValueError: No compatible linear kernel for 8-bit weights on CPU",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert _root_cause(stderr) == "ValueError: No compatible linear kernel for 8-bit weights on CPU"
    assert _root_cause("torch.OutOfMemoryError: CPU out of memory") == "torch.OutOfMemoryError: CPU out of memory"
    assert _root_cause("nothing went wrong here\n") is None


def test_a_kernel_refusal_keeps_its_reasons():
    """vLLM's worker logs the refusal with a record prefix, its reasons on the lines below."""
    log = "\n".join([
        "(Worker pid=329) ERROR 12-05 02:18:16 [multiproc_executor.py:953]     raise ValueError(",
        "(Worker pid=329) ERROR 12-05 02:18:16 [multiproc_executor.py:953] ValueError: Failed to find a kernel. Reasons: ",
        "(Worker pid=329) ERROR 12-05 02:18:16 [multiproc_executor.py:953]  CPUWNA16LinearKernel cannot implement due to: "
        "Quant type (uint8b128) not supported",
        "(EngineCore pid=316) INFO 12-05 02:18:16 [multiproc_executor.py:479] [shutdown] Executor: waiting",
        "(EngineCore pid=316) ERROR 12-05 02:18:19 [core.py:1510] Exception: WorkerProc initialization failed due to an "
        "exception in a background process. See stack trace for root cause.",
    ])
    assert _root_cause(log) == ("ValueError: Failed to find a kernel. Reasons: CPUWNA16LinearKernel cannot implement "
                                "due to: Quant type (uint8b128) not supported")
