"""Our model as an lm-evaluation-harness language model (the `lm_eval` package, extra `eval`), so
its tasks run on a checkpoint of any layout: `eval_tasks` in eval.py (docs/generate_eval.md).

The harness turns every task into three kinds of request; this adapter answers them with the model
loaded by megatron/inference/loading.py, under the run's compute precision:
- loglikelihood(context, continuation): the summed log-probability of the continuation's tokens
  after the context, and whether greedy decoding would have produced exactly them. Tokenisation
  (the pair split, an empty context replaced by end-of-document) is the harness's own TemplateLM.
- loglikelihood_rolling(text): the whole text scored in windows of the model's context, each token
  predicted once (the harness's window helpers), for perplexity tasks.
- generate_until(context, kwargs): greedy or sampled continuation (megatron/inference/
  text_generation.py) cut at the first stop string.

Imported only when eval_tasks is set: `import lm_eval` costs seconds and training never needs it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.inference.loading import InferenceModel
from megatron.inference.sampling import Sampling
from megatron.inference.text_generation import generate_tokens

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for generate_until requests without max_gen_toks


class NeoXTopoLM(TemplateLM):
    def __init__(self, im: InferenceModel, seed: int = 1234):
        super().__init__()
        self.im = im
        self._device = im.device
        self.generator = torch.Generator().manual_seed(seed)

    # -- what TemplateLM needs ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.im.tokenizer.eod_id

    @property
    def max_length(self) -> int:
        return self.im.max_positions

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.im.tokenizer.encode(string)

    @torch.no_grad()
    def continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) summed over its tokens, and whether each token is the argmax.
        Context beyond the model's window is dropped from the left (the continuation is kept whole)."""
        tokens = (context + continuation)[-(self.max_length + 1):]
        inputs = torch.tensor([tokens[:-1]], dtype=torch.long, device=self.im.device)
        with self.im.autocast():
            logits = self.im.model(inputs)[0, -len(continuation):, :self.im.tokenizer.vocab_size]
        logprobs = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation, dtype=torch.long, device=logprobs.device)
        picked = logprobs.gather(-1, target[:, None]).squeeze(-1)
        greedy = bool((logprobs.argmax(dim=-1) == target).all())
        return float(picked.sum()), greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for cache_key, context, continuation in requests:
            answer = self.continuation_logprob(context, continuation)
            self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            out.append(answer)
        return out

    # -- the other two request kinds ------------------------------------------------------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in (req.args for req in requests):
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(self.continuation_logprob(context, predicted)[0] for context, predicted in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            # the harness's convention: greedy unless do_sample (then temperature 1 unless given)
            sampled = bool(kwargs.get("do_sample", False))
            temperature = float(kwargs.get("temperature", 1.0 if sampled else 0.0)) if sampled else 0.0
            sampling = Sampling(temperature=temperature, top_k=int(kwargs.get("top_k", 0) or 0),
                                top_p=float(kwargs.get("top_p", 0.0) or 0.0))
            prompt = self.tok_encode(context) or [self.eot_token_id]
            done = generate_tokens(self.im, prompt, int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), sampling,
                                   generator=self.generator)
            text = self.im.tokenizer.decode(done.tokens)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out
