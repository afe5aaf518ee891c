"""Tokenizers (HF `tokenizer.json` or sentencepiece `tokenizer.model`), chat templates, EOS ids,
and a streaming detokenizer that never emits half a UTF-8 character."""

from __future__ import annotations

import json
from pathlib import Path

from pocket_mlx.config import text_config
from pocket_mlx.errors import PocketError, one_line


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _unreadable(file: Path, e: BaseException) -> PocketError:
    """A tokenizer file its library cannot parse (truncated download, wrong format) as the
    one-line error every command prints with exit 2, instead of the library's traceback."""
    why = one_line(e)[:200] or type(e).__name__
    return PocketError(f"{file}: cannot read this tokenizer file ({why}); download the model "
                       "again or replace the file")


def check_tokenizer_files(path: Path) -> None:
    """Parse the tokenizer files in `path` that exist, so that a command which only copies them
    (convert) refuses a broken one up front instead of writing a model that cannot load."""
    path = Path(path)
    if (file := path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        try:
            HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception
            raise _unreadable(file, e) from None
    elif (file := path / "tokenizer.model").is_file():
        import sentencepiece as spm

        try:
            spm.SentencePieceProcessor(model_file=str(file))
        except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError
            raise _unreadable(file, e) from None


class Tokenizer:
    """One face over both backends: encode, decode, chat template, EOS ids."""

    def __init__(self, path: Path, config: dict | None = None):
        self.path = Path(path)
        tcfg = _read_json(self.path / "tokenizer_config.json")
        # Each backend is imported when a model needs it: the other one would cost every start
        # ~20 ms for nothing.
        if (self.path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            file = self.path / "tokenizer.json"
            try:
                self._hf = HFTokenizer.from_file(str(file))
            except Exception as e:  # noqa: BLE001 - the library raises plain Exception
                raise _unreadable(file, e) from None
            self._sp = None
        elif (self.path / "tokenizer.model").is_file():
            import sentencepiece as spm

            file = self.path / "tokenizer.model"
            try:
                self._sp = spm.SentencePieceProcessor(model_file=str(file))
            except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError
                raise _unreadable(file, e) from None
            self._hf = None
        else:
            raise PocketError(f"{self.path} has no tokenizer.json or tokenizer.model")
        self.add_bos = bool(tcfg.get("add_bos_token", False))
        self.bos_token = _token_content(tcfg.get("bos_token"))
        self.eos_token = _token_content(tcfg.get("eos_token"))
        self.chat_template = self._find_template(tcfg)
        self.eos_token_ids = self._find_eos(config or {}, tcfg)
        self.special_ids = set(self.eos_token_ids)
        for tid, info in (tcfg.get("added_tokens_decoder") or {}).items():
            if isinstance(info, dict) and info.get("special"):
                self.special_ids.add(int(tid))

    # ---- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size() if self._hf else self._sp.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        if self._hf:
            return self._hf.token_to_id(token)
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._hf:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        else:
            ids = self._sp.encode(text)
        if add_special_tokens and self.add_bos and self.bos_token:
            bos = self.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._hf:
            return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._sp.decode(list(ids))

    # ---- chat -------------------------------------------------------------------------------
    def _find_template(self, tcfg: dict) -> str | None:
        """The chat template text; records where it came from in `chat_template_source` so
        that a broken template is reported by its file."""
        self.chat_template_source = ""
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            self.chat_template_source = str(jinja)
            try:
                return jinja.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise PocketError(f"{jinja} is not valid UTF-8 ({e.reason} at byte {e.start}); "
                                  "save the chat template as UTF-8") from None
        t = tcfg.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = [x for x in t if isinstance(x, dict) and isinstance(x.get("template"), str)]
            if not named:
                raise PocketError(f"{self.path / 'tokenizer_config.json'}: chat_template is a list "
                                  'without {"name": ..., "template": ...} entries; fix the file')
            t = next((x["template"] for x in named if x.get("name") == "default"),
                     named[0]["template"])
        if isinstance(t, str):
            self.chat_template_source = f"{self.path / 'tokenizer_config.json'} (chat_template)"
            return t
        js = _read_json(self.path / "chat_template.json").get("chat_template")
        if isinstance(js, str):
            self.chat_template_source = f"{self.path / 'chat_template.json'} (chat_template)"
            return js
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **extra) -> str:
        """Render the model's chat template in a sandbox with a size limit on its output and on
        every value it builds; any failure of the template (syntax, undefined names, security,
        limits, Python errors in it) is a `PocketError` naming the template's file. `tools`
        (OpenAI-shaped function definitions) and `extra` (e.g. `enable_thinking`) reach the
        template as transformers passes them."""
        if not self.chat_template:
            raise PocketError("this model has no chat template; use --raw")
        # Imported here: jinja2 costs ~25 ms of start-up that --raw does not need.
        from pocket_mlx.engine.templates import render_template

        where = self.chat_template_source or "the chat template"
        try:
            if tools is not None:  # left undefined otherwise, as before tools existed here
                extra["tools"] = tools
            return render_template(self.chat_template, **extra, messages=messages,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except PocketError as e:  # raise_exception() called by the template itself
            raise PocketError(f"chat template {where} refused the conversation: {e}") from None
        except Exception as e:  # noqa: BLE001 - the template is untrusted code; report any failure
            line = getattr(e, "lineno", None)
            at = f" (line {line})" if line else ""
            msg = one_line(e) or type(e).__name__
            raise PocketError(f"chat template {where} failed{at}: {type(e).__name__}: {msg}; "
                              "fix the template (or use generate --raw)") from None

    def _find_eos(self, config: dict, tcfg: dict) -> list[int]:
        ids: list[int] = []

        def add(v):
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and x not in ids:
                    ids.append(x)

        add(config.get("eos_token_id"))
        add(text_config(config).get("eos_token_id"))
        add(_read_json(self.path / "generation_config.json").get("eos_token_id"))
        if self.eos_token:
            add(self.token_to_id(self.eos_token))
        if not ids and self._sp is not None and self._sp.eos_id() >= 0:
            ids.append(self._sp.eos_id())
        return ids

    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Turns a token stream into text pieces; holds back an incomplete UTF-8 sequence (which
    decodes to U+FFFD) until the token that completes it arrives."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""  # text of self.tokens already handed out
        self.text = ""  # everything handed out so far

    def add(self, token: int) -> str:
        self.tokens.append(token)
        decoded = self.tokenizer.decode(self.tokens)
        if decoded.endswith("\ufffd"):
            return ""
        piece = decoded[len(self.emitted):]
        self.emitted = decoded
        self.text += piece
        if decoded.endswith("\n"):
            # Start a new segment: keeps decoding cost per token bounded.
            self.tokens, self.emitted = [], ""
        return piece

    def flush(self) -> str:
        """What is left at the end (a dangling partial character becomes U+FFFD)."""
        decoded = self.tokenizer.decode(self.tokens) if self.tokens else ""
        piece = decoded[len(self.emitted):]
        self.tokens, self.emitted = [], ""
        self.text += piece
        return piece


def load_tokenizer(path: Path, config: dict | None = None) -> Tokenizer:
    return Tokenizer(path, config)
