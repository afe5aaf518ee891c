"""Chat templates: jinja's immutable sandbox with limits on how large a template's values and
output may grow. A template is code from whoever made the model folder; a broken or hostile one
must fail fast with one line, not run the machine out of memory."""

from __future__ import annotations

import functools
import json
import re

from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pocket_mlx.errors import PocketError

# Most characters a chat template may produce, and the largest string, list or integer (in bits)
# it may build on the way. A conversation that fills a 1M-token context is ~4M characters.
TEMPLATE_MAX_CHARS = 16 * 2**20
TEMPLATE_MAX_INT_BITS = 2**16


def _too_big(what: str) -> SecurityError:
    return SecurityError(f"{what} would exceed the chat template limit of "
                         f"{TEMPLATE_MAX_CHARS} characters")


def _num(n: int) -> str:
    """An integer for an error line: in full when short, else by its size."""
    return str(n) if n.bit_length() <= 64 else f"a {n.bit_length()}-bit integer"


def _estimate(v, depth: int = 2) -> int:
    """Characters `str(v)` would take, roughly, without building it (a list of big strings)."""
    if isinstance(v, str):
        return len(v)
    if isinstance(v, (list, tuple, set, frozenset, dict)):
        if depth == 0 or len(v) > TEMPLATE_MAX_CHARS:
            return 4 * len(v)
        items = v.items() if isinstance(v, dict) else v
        flat = (x for kv in items for x in kv) if isinstance(v, dict) else items
        return sum(_estimate(x, depth - 1) + 2 for x in flat)
    return 32


def _checked(v, what: str = "a value"):
    """`v`, unless it is a string, container or integer over the limits."""
    if isinstance(v, (str, bytes, list, tuple, dict, set, frozenset)) and len(v) > TEMPLATE_MAX_CHARS:
        raise _too_big(what)
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > TEMPLATE_MAX_INT_BITS:
        raise SecurityError(f"{what} would exceed the chat template limit of "
                            f"{TEMPLATE_MAX_INT_BITS}-bit integers")
    return v


def _check_args(args, kwargs: dict | None = None) -> None:
    """Widths, counts and sizes passed to a call: none over the character limit."""
    for a in [*args, *(kwargs or {}).values()]:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_CHARS:
            raise _too_big(f"an argument of {_num(a)}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d*)(?:\.(\d*))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


def _check_format(fmt: str) -> None:
    """Field widths and precisions written in a %- or {}-format string."""
    nums = [g for m in _PERCENT_SPEC.finditer(fmt) for g in m.groups() if g]
    for m in _BRACE_FIELD.finditer(fmt):
        field = m.group(0)
        if ":" in field:
            nums += re.findall(r"\d+", field.split(":", 1)[1])
    for n in nums:
        if len(n) > 9 or int(n) > TEMPLATE_MAX_CHARS:
            raise _too_big(f"a format width of {n[:20]}")


def _check_replace(s, old, new, count=-1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        if len(s) + n * (len(new) - len(old)) > TEMPLATE_MAX_CHARS:
            raise _too_big("replace()")


def _check_join(sep, items: list) -> None:
    size = sum(_estimate(x) for x in items) + _estimate(sep) * max(len(items) - 1, 0)
    if size > TEMPLATE_MAX_CHARS:
        raise _too_big("join()")


def _checked_binop(op: str, left, right):
    """`left op right` for the operators that can grow a value faster than their operands."""
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if (isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int)
                    and _estimate(seq) * max(n, 0) > TEMPLATE_MAX_CHARS):
                raise _too_big(f"repeating a {type(seq).__name__} {_num(n)} times")
        if ints and left.bit_length() + right.bit_length() > TEMPLATE_MAX_INT_BITS:
            raise SecurityError("a product would exceed the chat template limit of "
                                f"{TEMPLATE_MAX_INT_BITS}-bit integers")
    elif op == "**":
        if ints and right > 0 and abs(left) > 1 and right * left.bit_length() > TEMPLATE_MAX_INT_BITS:
            raise SecurityError(f"{_num(left)} ** {_num(right)} would exceed the chat template limit of "
                                f"{TEMPLATE_MAX_INT_BITS}-bit integers")
    elif op == "%" and isinstance(left, str):
        _check_format(left)
        _check_args(right if isinstance(right, tuple) else (right,))
    return _checked(_BINOPS[op](left, right), f"the result of {op!r}")


_BINOPS = dict(ImmutableSandboxedEnvironment.default_binop_table)


def _guard_filter(name: str, f):
    """A filter that refuses the arguments that would build a value over the limits."""

    @functools.wraps(f)  # keeps jinja's pass_context/pass_eval_ctx marker
    def guarded(*args, **kwargs):
        _check_args(args, kwargs)
        plain = [a for a in args if not isinstance(a, (EvalContext, Context))]
        if name == "indent" and plain:
            width = kwargs.get("width", plain[1] if len(plain) > 1 else 4)
            w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            if (str(plain[0]).count("\n") + 1) * w + _estimate(plain[0]) > TEMPLATE_MAX_CHARS:
                raise _too_big("indent()")
        elif name == "replace" and len(plain) >= 3:
            _check_replace(str(plain[0]), str(plain[1]), str(plain[2]),
                           kwargs.get("count", plain[3] if len(plain) > 3 else -1) or -1)
        elif name == "format" and plain and isinstance(plain[0], str):
            _check_format(plain[0])
        elif name == "join" and plain:
            items = list(plain[0])
            if kwargs.get("attribute") is None and len(plain) < 3:
                _check_join(kwargs.get("d", plain[1] if len(plain) > 1 else ""), items)
            args = tuple(items if a is plain[0] else a for a in args)
        elif name == "tojson":
            indent = kwargs.get("indent", plain[1] if len(plain) > 1 else None)
            if isinstance(indent, int) and indent > 16:
                raise SecurityError("tojson indent above 16 is not allowed in a chat template")
        return _checked(f(*args, **kwargs), f"the result of |{name}")

    return guarded


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    """`tojson` as transformers' chat templates define it: plain `json.dumps` in the caller's
    key order, non-ASCII kept. Jinja's own sorts keys and escapes <, >, & and ' for HTML, so a
    tool definition would render differently from what the model was trained on."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys)


class _GuardedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to a join that checks the size first (jinja's own is unchecked)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.tilde_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, plus size limits: the operators, filters, string methods and
    joins that can make a value much larger than their inputs (`'a' * 10**9`, `center`,
    `'%9999999d'`, `replace`, `indent`, `join`, `~`, block captures) are checked before they
    run, and every other call's result after. Output is capped by `render_template`."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.filters["tojson"] = _tojson
        self.filters = {k: _guard_filter(k, f) for k, f in self.filters.items()}

        def raise_exception(msg):
            raise PocketError(str(msg))

        self.globals["raise_exception"] = raise_exception

    @staticmethod
    def concat(pieces) -> str:  # block captures, macro bodies: `concat = environment.concat`
        pieces = list(pieces)
        _check_join("", pieces)
        return "".join(pieces)

    @staticmethod
    def tilde_join(values: tuple) -> str:
        _check_join("", list(values))
        return "".join(str(v) for v in values)

    def call_binop(self, context, operator: str, left, right):
        return _checked_binop(operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        _check_args(args, kwargs)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                _check_format(owner)
            elif name == "replace":
                _check_replace(owner, *args[:3], **kwargs)
            elif name == "expandtabs":
                size = args[0] if args else kwargs.get("tabsize", 8)
                if isinstance(size, int) and owner.count("\t") * size + len(owner) > TEMPLATE_MAX_CHARS:
                    raise _too_big("expandtabs()")
            elif name == "join" and args:
                items = list(args[0])
                _check_join(owner, items)
                args = (items, *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        return _checked(result, f"the result of {name or 'a call'}()")


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    return _environment().from_string(source)


@functools.lru_cache(maxsize=1)
def _environment() -> TemplateEnvironment:
    return TemplateEnvironment()


def render_template(source: str, **context) -> str:
    """Render a chat template in `TemplateEnvironment`, stopping as soon as the output passes
    `TEMPLATE_MAX_CHARS` (a template is code from whoever made the model folder)."""
    out, n = [], 0
    for piece in _compile(source).generate(**context):
        n += len(piece)
        if n > TEMPLATE_MAX_CHARS:
            raise _too_big("the rendered template")
        out.append(piece)
    return "".join(out)

