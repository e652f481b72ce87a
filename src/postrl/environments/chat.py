"""The language models an environment or a stage talks to: an OpenAI-compatible endpoint or a local HF model.

:func:`endpoint_chat` posts an OpenAI chat request (``<base_url>/chat/completions``, stdlib urllib) and returns
the reply text; :class:`LocalChat` runs a local ``from_pretrained`` folder (loaded once per process and path) with
its chat template when it has one (otherwise the messages are joined as ``<role>content`` lines). Both raise
:class:`ChatError` for what the caller must treat as a failure of that call (HTTP error, timeout, a reply that is
not text); :func:`call_with_timeout` bounds any call by a wall-clock time in a daemon thread.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any, Callable


class ChatError(Exception):
    """One model call that failed (HTTP error, timeout, unreadable or empty reply)."""


class CallTimeout(ChatError):
    """A call that ran past its time limit (:func:`call_with_timeout`)."""


def endpoint_chat(base_url: str, model: str, messages: list[dict], *, timeout: float = 30.0,
                  temperature: float = 0.0, max_tokens: int = 256, api_key_env: str = "OPENAI_API_KEY") -> str:
    """The reply text of ``POST <base_url>/chat/completions`` (OpenAI format) for ``messages``."""
    url = base_url.rstrip("/")
    url = url if url.endswith("/chat/completions") else url + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(api_key_env) if api_key_env else None
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"model": model, "messages": messages, "temperature": temperature,
                       "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = json.loads(resp.read().decode("utf-8"))
        content = payload["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        raise ChatError(f"HTTP {e.code} from {url}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise ChatError(f"request to {url} failed: {getattr(e, 'reason', e)}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ChatError(f"malformed response from {url}") from None
    if not isinstance(content, str):
        raise ChatError(f"reply from {url} is not text: {type(content).__name__}")
    return content


_LOCAL: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()


class LocalChat:
    """A local causal LM (``path``: a ``from_pretrained`` folder), loaded once per process; ``__call__(messages)``
    returns its reply (greedy when ``temperature`` is 0, else sampled with ``seed``), at most ``max_tokens``."""

    def __init__(self, path: str, *, max_tokens: int = 64, temperature: float = 0.0):
        self.path, self.max_tokens, self.temperature = str(path), int(max_tokens), float(temperature)

    def _load(self):
        with _LOCAL_LOCK:
            if self.path not in _LOCAL:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self.path)
                model = AutoModelForCausalLM.from_pretrained(self.path)
                model.eval()
                _LOCAL[self.path] = (model, tok, threading.Lock())
            return _LOCAL[self.path]

    def render(self, tok: Any, messages: list[dict]) -> str:
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def __call__(self, messages: list[dict], seed: int = 0) -> str:
        import torch

        model, tok, lock = self._load()
        ids = tok(self.render(tok, messages), return_tensors="pt", add_special_tokens=False)["input_ids"]
        with lock, torch.no_grad():  # one generation at a time per model
            torch.manual_seed(seed)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens,
                                 do_sample=self.temperature > 0, temperature=self.temperature or None,
                                 top_k=None, top_p=None, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def call_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()``'s result within ``timeout`` seconds; raises what it raised, or :class:`ChatError` when it runs
    past the timeout (:class:`CallTimeout`; its daemon thread is abandoned)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="postrl-chat")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise CallTimeout(f"no reply within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
