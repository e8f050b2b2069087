"""lm-evaluation-harness on quantkit's runtime (`--lm-eval TASKS`), through the harness's model interface.

Only used when the `lm-eval` package is installed; the harness fetches its own task data.
"""

from __future__ import annotations

import torch

from quantkit.errors import InputError


def _make_lm_class():
    from quantkit.optional import require

    require("lm_eval", "eval --lm-eval")
    from lm_eval.api.model import LM

    class QuantkitLM(LM):
        def __init__(self, runtime, tokenizer, max_length: int = 2048):
            super().__init__()
            self.rt, self.tok, self.max_length = runtime, tokenizer, max_length

        @torch.inference_mode()
        def _score(self, context_ids: list[int], cont_ids: list[int]) -> tuple[float, bool]:
            seq = (context_ids + cont_ids)[-(self.max_length + 1):]
            n = len(cont_ids)
            ids = torch.tensor([seq[:-1]], device=self.rt.device)
            logp = torch.log_softmax(self.rt(input_ids=ids).logits[0, -n:].double(), dim=-1).cpu()
            target = torch.tensor(cont_ids)
            ll = float(logp[torch.arange(n), target].sum())
            return ll, bool((logp.argmax(-1) == target).all())

        def _prefix_token(self) -> int:
            return self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id

        def loglikelihood(self, requests):
            from quantkit.eval.tasks import encode_pair

            out = []
            for req in requests:
                context, continuation = req.args[0], req.args[1]
                if context:
                    ctx, cont = encode_pair(self.tok, context, continuation)
                else:  # unconditional: score after a start token
                    ctx, cont = [self._prefix_token()], self.tok(continuation, add_special_tokens=False).input_ids
                out.append(self._score(ctx, cont))
            return out

        def loglikelihood_rolling(self, requests):
            out = []
            for req in requests:
                ids = self.tok(req.args[0], add_special_tokens=False).input_ids
                total = 0.0
                for s in range(0, len(ids), self.max_length):
                    prefix = [self._prefix_token()] if s == 0 else ids[max(0, s - self.max_length):s]
                    total += self._score(prefix[-self.max_length:], ids[s:s + self.max_length])[0]
                out.append(total)
            return out

        def generate_until(self, requests):
            from quantkit.runtime.generate import generate

            out = []
            for req in requests:
                context, kwargs = req.args[0], dict(req.args[1])
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else until
                ids = torch.tensor([self.tok(context).input_ids], device=self.rt.device)
                gen = generate(self.rt, ids, int(kwargs.get("max_gen_toks", 256)), eos_token_id=self.tok.eos_token_id)
                text = self.tok.decode(gen.tokens[0], skip_special_tokens=True)
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
            return out

    return QuantkitLM


def run_lm_eval(runtime, tokenizer, tasks: str) -> dict:
    QuantkitLM = _make_lm_class()
    from lm_eval import simple_evaluate

    try:
        res = simple_evaluate(model=QuantkitLM(runtime, tokenizer), tasks=[t for t in tasks.split(",") if t])
    except Exception as exc:
        raise InputError(f"lm-eval failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for task, metrics in res.get("results", {}).items()}
