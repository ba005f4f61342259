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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat_template in tokenizer_config.json")
        import jinja2  # lazy: only a chat template needs it

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        tpl = env.from_string(self.chat_template)
        special = {k: (v.get("content") if isinstance(v, dict) else v)
                   for k, v in self.config.items() if k.endswith("_token")}
        return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
