"""Tokenizer from a model folder: tokenizer.json (HF tokenizers) plus tokenizer_config.json for
special tokens and the chat template. Token-id prompts never need one."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_file = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token_id = self._token_id(self.config.get("eos_token"))
        self.bos_token_id = self._token_id(self.config.get("bos_token"))

    @staticmethod
    def exists(folder: str | Path) -> bool:
        return (Path(folder) / "tokenizer.json").is_file()

    def _token_id(self, token: object) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def backend(self) -> _HFTokenizer:
        """The tokenizers-library object (vocabulary and decoder, for grammar compilation)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; the tokenizer's post-processor (a BOS, say) only when asked."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def piece(self, token: int) -> str | None:
        """The vocabulary piece of one id, as stored (byte-level pieces keep their marks)."""
        return self._tok.id_to_token(token)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: object) -> str:
        """The template rendered as HF's apply_chat_template does: ``tools`` and ``kwargs``
        (e.g. ``enable_thinking``) are template variables, the special tokens too; HF's
        ``tojson`` (no HTML escaping), ``raise_exception`` and loop controls. A template that
        fails (or raises) is a TokenizerError with its message."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat_template in tokenizer_config.json")
        import jinja2  # lazy: only a chat template needs it
        import jinja2.ext  # lazy: as above
        import jinja2.sandbox  # lazy: as above

        def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"the chat template refused the messages: {message}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        special = {k: (v.get("content") if isinstance(v, dict) else v)
                   for k, v in self.config.items() if k.endswith("_token")}
        try:
            tpl = env.from_string(self.chat_template)
            return tpl.render({**special, **kwargs, "messages": messages, "tools": tools,
                               "add_generation_prompt": add_generation_prompt})
        except TokenizerError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TokenizerError(f"the chat template failed: {type(e).__name__}: {e}") from None
