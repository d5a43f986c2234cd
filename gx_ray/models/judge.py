"""LLM judges for :mod:`gx_ray.metrics.cascade`: ``ask(prompt) -> reply`` callables backed by a local transformers
causal LM or by an OpenAI-compatible chat-completions endpoint (vLLM, a hosted API)."""

from __future__ import annotations

import json
from collections.abc import Callable


def endpoint_judge(url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0) -> Callable[[str], str]:
    """A judge behind an OpenAI-compatible chat-completions endpoint (vLLM, a hosted API): ``url`` is its base
    (``http://host:8000``, ``…/v1`` accepted), ``model`` the served model's name; greedy, one reply per prompt."""
    import urllib.request

    base = url.rstrip("/").removesuffix("/v1")

    def ask(prompt: str) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 512}
        request = urllib.request.Request(
            f"{base}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = json.loads(response.read())
        return reply["choices"][0]["message"]["content"] or ""

    return ask


def local_judge(name_or_path: str, max_new_tokens: int = 256, device: str = "cpu") -> Callable[[str], str]:
    """A judge that is a local transformers causal LM (a hub name or a folder), asked through its chat template where
    it has one; greedy decoding, the reply without the prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gx_ray.models.text import quiet_loading

    quiet_loading()
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path).to(device).eval()

    def ask(prompt: str) -> str:
        import torch

        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        encoded = tokenizer(text, return_tensors="pt")
        inputs = {k: encoded[k].to(device) for k in ("input_ids", "attention_mask")}  # no BERT-style token types
        with torch.no_grad():
            output = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    return ask
