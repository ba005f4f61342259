"""Tokenizer from a model folder: tokenizer.json (HF tokenizers) plus tokenizer_config.json for
special tokens and the chat template. Token-id prompts never need one."""
from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


def vocab_kind(spec: dict) -> tuple[str, bool]:
    """(xgrammar vocab type name, add_prefix_space) read off a tokenizer.json: byte-level BPE
    (GPT-2 style byte-to-unicode pieces), byte-fallback (SentencePiece ``<0xNN>`` pieces, ``▁``
    for spaces) or raw pieces."""
    dec = spec.get("decoder") or {}
    parts = dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]
    types = {d.get("type") for d in parts if isinstance(d, dict)}
    if "ByteLevel" in types:
        return "BYTE_LEVEL", False
    if "ByteFallback" not in types:
        return "RAW", False
    norm = spec.get("normalizer") or {}
    norms = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    prepend = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in norms)
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    meta = any(p.get("type") == "Metaspace"
               and p.get("prepend_scheme", "always") in ("always", "first")
               for p in pres)
    return "BYTE_FALLBACK", prepend or meta


def _byte_level_map() -> dict[str, int]:
    """ByteLevel's printable stand-in character -> the byte it encodes: printable Latin-1
    bytes stand for themselves, the other 68 take code points 256 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF = _byte_level_map()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_file = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token_id = self._token_id(self.config.get("eos_token"))
        self.bos_token_id = self._token_id(self.config.get("bos_token"))
        self._kind: str | None = None          # vocab_kind, read on the first token_bytes
        self._specials = {i for i, a in self._tok.get_added_tokens_decoder().items() if a.special}

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

    def token_bytes(self, token: int) -> list[int] | None:
        """The bytes a token stands for (OpenAI's logprob ``bytes``), also for a token that
        holds part of a UTF-8 character and so decodes to U+FFFD alone; a special token's are
        empty (it decodes to nothing); None for an id the vocabulary lacks."""
        piece = self._tok.id_to_token(token)
        if piece is None:
            return None
        if token in self._specials:
            return []
        if self._kind is None:
            self._kind = vocab_kind(json.loads(self._tok.to_str()))[0]
        if self._kind == "BYTE_LEVEL" and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
        if self._kind == "BYTE_FALLBACK":
            m = _BYTE_PIECE.fullmatch(piece)
            return [int(m.group(1), 16)] if m else list(piece.replace("\u2581", " ").encode())
        return list(piece.encode())

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
