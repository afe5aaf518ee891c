"""Quantization recipes: ordered rules that give every quantizable module its bits (or float).

A recipe is a list of `(pattern, spec)` rules matched against full module paths
(`language_model.model.layers.3.mlp.switch_mlp.gate_proj`); the first match wins, and modules no
rule matches get the recipe's default. The result is written as mlx-lm's per-module
`quantization` dict, so stock mlx-lm loads the mixed-precision checkpoint unchanged.
See docs/RECIPES.md for the built-in recipes and the TOML format of user recipes.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pocket_mlx.config import AFFINE_BITS, GROUP_SIZES
from pocket_mlx.errors import PocketError

# Every width MLX's affine format packs, 1 bit included (stock MLX and mlx-lm run 1-bit; our
# CPU kernels take the widths they support and leave the rest to MLX: kernels/ops.py).
VALID_BITS = AFFINE_BITS
VALID_GROUPS = GROUP_SIZES
DEFAULT_GROUP = 64


@dataclass(frozen=True)
class Spec:
    bits: int
    group_size: int = DEFAULT_GROUP

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits}

    def label(self) -> str:
        return f"{self.bits}-bit g{self.group_size}"


FLOAT = None  # a rule or default of FLOAT keeps the module in floating point


@dataclass(frozen=True)
class Rule:
    pattern: str  # as written, for pocket.json and error messages
    regex: re.Pattern
    spec: Spec | None

    def matches(self, path: str) -> bool:
        return self.regex.fullmatch(path) is not None


def glob_rule(pattern: str, spec: Spec | None) -> Rule:
    return Rule(pattern, re.compile(fnmatch.translate(pattern)), spec)


def regex_rule(pattern: str, spec: Spec | None) -> Rule:
    try:
        return Rule(f"re:{pattern}", re.compile(pattern), spec)
    except re.error as e:
        raise PocketError(f"recipe: bad regex {pattern!r}: {e}") from None


@dataclass
class Recipe:
    name: str
    rules: list[Rule] = field(default_factory=list)
    default: Spec | None = FLOAT

    @property
    def quantizes(self) -> bool:
        return self.default is not None or any(r.spec is not None for r in self.rules)

    def spec_for(self, path: str) -> Spec | None:
        """The first matching rule's spec, else the default (None = keep float)."""
        for rule in self.rules:
            if rule.matches(path):
                return rule.spec
        return self.default

    def resolve(self, path: str, in_dims: int) -> tuple[Spec | None, str | None]:
        """Spec for a module with `in_dims` inputs, plus a note when it must stay float
        (MLX quantizes along the input dimension in whole groups)."""
        spec = self.spec_for(path)
        if spec is not None and in_dims % spec.group_size:
            return None, (f"{path}: input dim {in_dims} is not a multiple of group size "
                          f"{spec.group_size}; kept float")
        return spec, None

    def describe(self) -> dict:
        def s(spec):
            return "float" if spec is None else spec.as_dict()

        return {"name": self.name, "rules": [{"pattern": r.pattern, "spec": s(r.spec)}
                                             for r in self.rules],
                "default": s(self.default)}


# ---- module families: used for reporting bits per family and by the built-in recipes ---------


def family(path: str) -> str:
    if ".switch_mlp." in path:
        return "experts"
    if path.endswith("mlp.gate"):
        return "router"
    if path.endswith("shared_expert_gate"):
        return "shared_expert_gate"
    if ".shared_expert." in path:
        return "shared_expert"
    if ".self_attn." in path:
        return "attention"
    if ".linear_attn." in path:
        return "linear_attention"
    if path.endswith("embed_tokens"):
        return "embed_tokens"
    if path.endswith("lm_head"):
        return "lm_head"
    return "other"


def _pocket(expert_bits: int) -> Recipe:
    """POCKET mixed precision: low-bit routed experts, 8-bit routers, 4-bit attention and
    shared expert, 6-bit embeddings and lm_head (the quality-critical, per-token-read parts)."""
    g = DEFAULT_GROUP
    rules = [
        glob_rule("*.mlp.gate", Spec(8, g)),
        glob_rule("*.shared_expert_gate", Spec(8, g)),
        glob_rule("*.switch_mlp.*", Spec(expert_bits, g)),
        glob_rule("*.shared_expert.*", Spec(4, g)),
        glob_rule("*.self_attn.*", Spec(4, g)),
        glob_rule("*.linear_attn.*", Spec(4, g)),
        glob_rule("*embed_tokens", Spec(6, g)),
        glob_rule("*lm_head", Spec(6, g)),
    ]
    return Recipe(f"pocket-{expert_bits}bit", rules, default=Spec(4, g))


def builtin(name: str) -> Recipe | None:
    if name in ("bf16", "float"):
        return Recipe(name, [], FLOAT)
    if m := re.fullmatch(r"uniform-(\d)", name):
        bits = int(m.group(1))
        if bits in (1, 2, 3, 4, 6, 8):
            return Recipe(name, [], Spec(bits, DEFAULT_GROUP))
    if name in ("pocket-1bit", "pocket-2bit", "pocket-3bit"):
        return _pocket(int(name[7]))
    return None


BUILTIN_NAMES = ("bf16", "float", "uniform-1", "uniform-2", "uniform-3", "uniform-4", "uniform-6",
                 "uniform-8", "pocket-1bit", "pocket-2bit", "pocket-3bit")


def _spec(entry: dict | str, where: str, group_size: int) -> Spec | None:
    if entry == "float":
        return FLOAT
    if not isinstance(entry, dict):
        raise PocketError(f"recipe: {where} must be a table with bits, or \"float\"")
    if entry.get("float") is True:
        return FLOAT
    bits, gs = entry.get("bits"), entry.get("group_size", group_size)
    if bits not in VALID_BITS:
        raise PocketError(f"recipe: {where}: bits must be one of {VALID_BITS}, got {bits!r}")
    if gs not in VALID_GROUPS:
        raise PocketError(f"recipe: {where}: group_size must be one of {VALID_GROUPS}, got {gs!r}")
    return Spec(bits, gs)


def parse_recipe(text: str, name: str) -> Recipe:
    """A TOML recipe: `[[rules]]` with `glob` or `regex` and `bits`/`group_size` or
    `float = true`; optional `default`, `group_size`, `name` and `base` (a built-in whose
    rules follow the file's own)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PocketError(f"recipe {name}: not valid TOML: {e}") from None
    known = {"name", "rules", "default", "group_size", "base"}
    if unknown := sorted(set(data) - known):
        raise PocketError(f"recipe {name}: unknown key {unknown[0]!r} "
                          f"(known: {', '.join(sorted(known))})")
    gs = data.get("group_size", DEFAULT_GROUP)
    if gs not in VALID_GROUPS:
        raise PocketError(f"recipe {name}: group_size must be one of {VALID_GROUPS}")
    rules_in = data.get("rules", [])
    if not isinstance(rules_in, list):
        raise PocketError(f"recipe {name}: `rules` must be an array of tables ([[rules]])")
    rules = []
    for i, r in enumerate(rules_in, 1):
        where = f"rule {i}"
        if not isinstance(r, dict):
            raise PocketError(f"recipe {name}: {where} is not a table")
        if unknown := sorted(set(r) - {"glob", "regex", "bits", "group_size", "float"}):
            raise PocketError(f"recipe {name}: {where}: unknown key {unknown[0]!r}")
        if ("glob" in r) == ("regex" in r):
            raise PocketError(f"recipe {name}: {where} needs exactly one of glob or regex")
        spec = _spec({k: v for k, v in r.items() if k not in ("glob", "regex")}, where, gs)
        pat = r.get("glob", r.get("regex"))
        if not isinstance(pat, str) or not pat:
            raise PocketError(f"recipe {name}: {where}: the pattern must be a non-empty string")
        rules.append(glob_rule(pat, spec) if "glob" in r else regex_rule(pat, spec))
    default = FLOAT
    base = None
    if "base" in data:
        base = builtin(str(data["base"]))
        if base is None:
            raise PocketError(f"recipe {name}: unknown base recipe {data['base']!r}")
        rules += base.rules
        default = base.default
    if "default" in data:
        default = _spec(data["default"], "default", gs)
    if not rules and default is None:
        raise PocketError(f"recipe {name}: no rules and no default: it would quantize nothing")
    return Recipe(str(data.get("name", name)), rules, default)


def load_recipe(name_or_file: str) -> Recipe:
    """A built-in recipe by name, or a TOML file."""
    recipe = builtin(name_or_file)
    if recipe is not None:
        return recipe
    path = Path(name_or_file)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise PocketError(f"recipe file {path} does not exist")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PocketError(f"cannot read recipe file {path}: {e}") from None
        return parse_recipe(text, path.stem)
    raise PocketError(f"unknown recipe {name_or_file!r} (built-in: {', '.join(BUILTIN_NAMES)}; "
                      "or a .toml file)")
