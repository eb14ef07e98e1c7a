"""Parser for the IR text form: `parse_graph(print_graph(g))` rebuilds `g` (the inverse of qcompile.ir.printer).

Why: the text form is the one debugging surface. Dumps, `--print-ir-after` output, hand-written reproducers and
golden tests are all text, and reading them back makes them runnable again. The parser is deliberately faithful
rather than helpful: it keeps the result types written in the text (Builder.add_typed, no re-inference), so a graph
with wrong types loads and `verify` reports it. It checks only what it needs to build a graph — names, syntax,
op names, attribute names — and reports each problem as one line `<source>:<line>: <problem>` (exit code 65).

Grammar (one statement per line; blank lines and `//` comment lines are skipped anywhere):

    graph @<title> {
      mesh {axes=[...], shape=[...], devices=[...], rules=[...]}   (optional, first: ir/mesh.py)
      %a = input "<name>" : <type>                       (also: param)
      %a, %b = <op>(%x, %y) {key=value, ...} : <type>, <type>
      return <name>=%a, ...
    }

Attribute values: "strings" (\\ \" \n \t \r escapes), ints, floats (incl. inf/nan), true/false, None and [lists]
(which become tuples). Types are TensorType text (`f32[T*2,96]`, sharded `f32[64,96]<experts,_>`) split at commas
outside brackets.
"""

from __future__ import annotations

import inspect
import re

import attrs

from qcompile.errors import CheckpointError, one_line
from qcompile.ir import ops as _ops  # noqa: F401  (registers the op catalogue)
from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Value
from qcompile.ir.mesh import Mesh
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.registry import OPS, TYPE_RULES, OpTypeError
from qcompile.ir.types import parse_type


class IRParseError(CheckpointError):
    """Malformed IR text (bad input, exit code 65). Message: `<source>:<line>: <problem>`."""

    def __init__(self, source: str, line: int, problem: str):
        super().__init__(f"{source}:{line}: {one_line(problem)}")
        self.source, self.line, self.problem = source, line, problem


_TOKEN = re.compile(r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<num>-?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf\b|nan\b))
    | (?P<val>%[\w.]+)
    | (?P<name>[A-Za-z_][\w.]*)
    | (?P<punct>[=,(){}\[\]:])
)""", re.X)
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r"}
_CONSTANTS = {"true": True, "false": False, "None": None}
_HEADER = re.compile(r"graph\s+@(.+?)\s*\{")


class _Line:
    """A cursor over one line's tokens; tokenizes lazily so the raw type text after ':' is never tokenized."""

    def __init__(self, text: str, fail):
        self.text, self.pos, self.fail = text, 0, fail

    def peek(self) -> tuple[str, str] | None:
        if not self.text[self.pos:].strip():
            return None
        m = _TOKEN.match(self.text, self.pos)
        if not m:
            self.fail(f"cannot read {self.text[self.pos:].strip()[:40]!r}")
        return m.lastgroup, m.group(m.lastgroup)

    def next(self, kind: str | None = None, text: str | None = None, what: str = "") -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (kind and tok[0] != kind) or (text and tok[1] != text):
            got = "end of line" if tok is None else repr(tok[1])
            self.fail(f"expected {what or repr(text) or kind}, got {got}")
        self.pos = _TOKEN.match(self.text, self.pos).end()
        return tok

    def at(self, text: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == "punct" and tok[1] == text

    def rest(self) -> str:
        return self.text[self.pos:].strip()

    def string(self, token: str) -> str:
        def unescape(m):
            if m.group(1) not in _ESCAPES:
                self.fail(f"unknown escape \\{m.group(1)} in string {token}")
            return _ESCAPES[m.group(1)]

        return re.sub(r"\\(.)", unescape, token[1:-1])

    def value(self):
        kind, tok = self.next(what="an attribute value")
        if kind == "str":
            return self.string(tok)
        if kind == "num":
            return int(tok) if re.fullmatch(r"-?\d+", tok) else float(tok)
        if kind == "name" and tok in _CONSTANTS:
            return _CONSTANTS[tok]
        if tok == "[":
            return tuple(self.separated("]", self.value))
        self.fail(f"bad attribute value {tok!r}")

    def separated(self, close: str, item) -> list:
        """`item (',' item)* close`, possibly empty; the opening bracket is already consumed."""
        items = []
        while not self.at(close):
            items.append(item())
            if not self.at(close):
                self.next("punct", ",", f"',' or {close!r}")
        self.next("punct", close)
        return items


def _split_types(text: str) -> list[str]:
    """Split at commas outside [...] and <...> (types have commas inside their shapes and shardings)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "[<") - (char in "]>")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _make_op(cls, attributes: dict, fail):
    fields = {f.alias: f for f in attrs.fields(cls) if f.init}
    for key in attributes:
        if key not in fields:
            fail(f"op {cls.op_name!r} has no attribute {key!r} (it has: {', '.join(fields) or 'none'})")
    for key, field in fields.items():
        if key not in attributes and field.default is attrs.NOTHING:
            fail(f"op {cls.op_name!r} is missing attribute {key!r}")
    try:
        return cls(**attributes)
    except (TypeError, ValueError) as err:
        fail(f"bad attributes for op {cls.op_name!r}: {err}")


def parse_graph(text: str, source: str = "<text>", meta: dict | None = None) -> Graph:
    """Parse the text form (see module docstring) into a Graph. `meta` is merged in; the title sets meta["name"].

    Raises IRParseError on malformed text. The result is not verified: call qcompile.ir.verifier.verify.
    """
    builder = Builder()
    values: dict[str, tuple[Value, int]] = {}  # %name -> (value, defining line)
    title = None
    mesh = None
    returned = closed = False
    lineno = 0

    def fail(problem: str):
        raise IRParseError(source, lineno, problem)

    for lineno, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if closed:
            fail(f"text after the closing '}}': {stripped[:40]!r}")
        if title is None:
            m = _HEADER.fullmatch(stripped)
            if not m:
                fail(f"expected 'graph @name {{', got {stripped[:40]!r}")
            title = m.group(1)
        elif stripped == "}":
            if not returned:
                fail("missing 'return' line before '}'")
            closed = True
        elif returned:
            fail(f"expected '}}' after the return line, got {stripped[:40]!r}")
        elif stripped.startswith("mesh ") or stripped.startswith("mesh{"):
            if mesh is not None or values:
                fail("the mesh statement comes once, first in the graph")
            mesh = _mesh(_Line(stripped, fail), fail)
        elif stripped == "return" or stripped.startswith("return "):
            for name, ref in _outputs(_Line(stripped[len("return"):], fail)):
                if ref not in values:
                    fail(f"output {name!r} refers to undefined value {ref}")
                try:
                    builder.output(name, values[ref][0])
                except OpTypeError as err:
                    fail(str(err))
            returned = True
        else:
            _statement(_Line(stripped, fail), builder, values, lineno, fail)
    if title is None:
        fail("expected 'graph @name {', got no graph")
    if not closed:
        fail("missing closing '}' at end of graph")
    extra = {"mesh": mesh} if mesh is not None else {}
    return builder.build({**(meta or {}), **extra, "name": title})


def _outputs(line: _Line) -> list[tuple[str, str]]:
    """`name=%v, ...` (names may be quoted)."""
    outputs = []
    while line.peek() is not None:
        if outputs:
            line.next("punct", ",", "',' between outputs")
        kind, name = line.next(what="an output name")
        if kind not in ("name", "str"):
            line.fail(f"expected an output name, got {name!r}")
        line.next("punct", "=")
        outputs.append((line.string(name) if kind == "str" else name, line.next("val", what="a %value")[1]))
    return outputs


def _attributes(line: _Line, fail, what: str) -> dict:
    """`key=value, ...}` after an opening '{' (keys unique)."""
    attributes: dict = {}

    def attribute():
        key = line.next("name", what=f"a {what} name")[1]
        line.next("punct", "=")
        if key in attributes:
            fail(f"{what} {key!r} given twice")
        attributes[key] = line.value()

    line.separated("}", attribute)
    return attributes


def parse_mesh_statement(text: str, source: str = "<text>") -> Mesh | None:
    """The mesh of a graph's text form (None when it has none), without parsing the graph: the mesh statement, when
    present, is the first statement after the header."""
    for lineno, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("//") or stripped.startswith("graph "):
            continue
        if not (stripped.startswith("mesh ") or stripped.startswith("mesh{")):
            return None

        def fail(problem: str, lineno=lineno):
            raise IRParseError(source, lineno, problem)

        return _mesh(_Line(stripped, fail), fail)
    return None


def _mesh(line: _Line, fail) -> Mesh:
    """`mesh {axes=[...], shape=[...], devices=[...], rules=[[logical, mesh_axis, ...], ...]}`."""
    line.next("name", "mesh")
    line.next("punct", "{", "'{' after mesh")
    attributes = _attributes(line, fail, "mesh attribute")
    if line.peek() is not None:
        fail(f"unexpected {line.rest()[:40]!r} after the mesh statement")
    try:
        return Mesh.from_attributes(attributes)
    except (TypeError, ValueError) as err:
        fail(f"bad mesh: {err}")


def _statement(line: _Line, builder: Builder, values: dict, lineno: int, fail) -> None:
    """`%a, %b = op(%x, ...) {k=v, ...} : type, type` or `%a = input|param "name" : type`."""
    results = [line.next("val", what="a %result name")[1]]
    while line.at(","):
        line.next()
        results.append(line.next("val", what="a %result name")[1])
    line.next("punct", "=")
    op_name = line.next("name", what="an op name")[1]
    cls = OPS.get(op_name)
    if cls is None:
        fail(f"unknown op {op_name!r}")
    leaf = cls in (Input, Param)
    operands, attributes = [], {}
    if leaf:
        leaf_name = line.string(line.next("str", what=f'a quoted {op_name} name')[1])
    else:
        line.next("punct", "(", f"'(' after {op_name}")
        for ref in line.separated(")", lambda: line.next("val", what="a %value")[1]):
            if ref not in values:
                fail(f"operand {ref} is not defined before use")
            operands.append(values[ref][0])
        if line.at("{"):
            line.next()
            attributes = _attributes(line, fail, "attribute")
    line.next("punct", ":", "':' before the result types")
    type_text = line.rest()
    if not type_text:
        fail("missing result types after ':'")
    types = []
    for part in _split_types(type_text):
        try:
            types.append(parse_type(part))
        except (TypeError, ValueError) as err:
            fail(f"malformed type {part.strip()!r}: {err}")
    if len(types) != len(results):
        fail(f"{len(results)} result name(s) but {len(types)} type(s)")
    if leaf:
        op = cls(leaf_name, types[0])
    else:
        op = _make_op(cls, attributes, fail)
        try:
            inspect.signature(TYPE_RULES[cls]).bind(op, *operands)
        except TypeError:
            fail(f"op {op_name!r} cannot take {len(operands)} operand(s)")
    for name in results:
        if results.count(name) > 1:
            fail(f"{name} is defined twice on this line")
        if name in values:
            fail(f"{name} is already defined on line {values[name][1]}")
    produced = builder.add_typed(op, operands, types)
    produced = produced if isinstance(produced, tuple) else (produced,)
    for name, value in zip(results, produced):
        values[name] = (value, lineno)
