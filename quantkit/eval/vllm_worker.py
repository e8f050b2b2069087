"""One model in vLLM, for `quantkit eval --engine vllm`: prompt log-probabilities of the eval blocks and
generation throughput, measured by vLLM itself.

    PYTHON quantkit/eval/vllm_worker.py REQUEST.json RESULT.json

Runs in whatever interpreter has vLLM (often its own venv, without quantkit), so it imports only the standard
library and vLLM. The request names one model, the token blocks, the number of top log-probabilities per
position, the dtype, the tensor-parallel size and the throughput prompts; the result holds, per block and per
position t >= 1, the log-probability of the real token t and the top-k (id, log-probability) pairs of the
distribution predicting it.
"""

from __future__ import annotations

import json
import sys
import time


def _positions(prompt_logprobs, ids, k):
    actual, top_ids, top_lps = [], [], []
    for t in range(1, len(ids)):
        entry = prompt_logprobs[t]
        actual.append(float(entry[ids[t]].logprob))
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
        top_ids.append([int(i) for i, _ in ranked])
        top_lps.append([float(lp.logprob) for _, lp in ranked])
    return {"actual": actual, "top_ids": top_ids, "top_logprobs": top_lps}


def run(request: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt

        def prompt(ids):
            return TokensPrompt(prompt_token_ids=ids)
    except ImportError:  # older vLLM
        def prompt(ids):
            return {"prompt_token_ids": ids}

    began = time.perf_counter()
    llm = LLM(model=request["model"], dtype=request["dtype"], tensor_parallel_size=request["tensor_parallel_size"],
              max_model_len=request["max_model_len"], enforce_eager=True, seed=0,
              kv_cache_dtype=request.get("kv_cache_dtype", "auto"))
    loaded = time.perf_counter() - began
    k = request["top_logprobs"]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
    began = time.perf_counter()
    outs = llm.generate([prompt(ids) for ids in request["blocks"]], params, use_tqdm=False)
    scored = time.perf_counter() - began
    result = {"ok": True, "vllm_version": vllm.__version__, "load_s": round(loaded, 2), "score_s": round(scored, 2),
              "blocks": [_positions(o.prompt_logprobs, ids, k) for o, ids in zip(outs, request["blocks"])]}
    tp = request.get("throughput")
    if tp:
        gen = SamplingParams(max_tokens=tp["max_tokens"], temperature=0.0, ignore_eos=True)
        figures = {}
        for batch in tp["batches"]:
            prompts = [prompt(ids) for ids in tp["prompts"][:batch]]
            llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm
            began = time.perf_counter()
            res = llm.generate(prompts, gen, use_tqdm=False)
            wall = time.perf_counter() - began
            tokens = sum(len(r.outputs[0].token_ids) for r in res)
            figures[f"generate_tok_s_b{batch}"] = round(tokens / wall, 2)
        result["throughput"] = {**figures, "prompt_tokens": len(tp["prompts"][0]), "new_tokens": tp["max_tokens"]}
    return result


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    try:
        result = run(request)
    except Exception as exc:  # reported by quantkit as one line naming the model
        # The first lines: a pydantic ValidationError says what is wrong on its second line
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()][:2]
        result = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(lines)[:400]}"}
    with open(sys.argv[2], "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
