"""String formats pydantic's own types emit (IPv6Address, IPvAnyAddress, timedelta, bytes, Path,
SecretStr), each against an independent reader: Python's ``ipaddress`` and pydantic's validators, on
random texts and on random draws under the mask."""

import datetime
import ipaddress
import json
import pathlib
import random
from typing import Annotated

import pytest

from hypic.engine.structured import compile_schema
from tests.engine.test_structured import _matches, _written, tokenizer, vocab  # noqa: F401 — module-scoped fixtures

pytest.importorskip("pydantic")  # the references here; the GPU machine's environment lacks it
from pydantic import Field, IPvAnyAddress, SecretStr, TypeAdapter  # noqa: E402

PIECES = ["0", "1", "a", "F", "ffff", "12345", "1.2.3.4", "255.255.255.255", "256.1.1.1", "01.2.3.4",
          ":", "::", ":::", ".", "g", "%1"]


def _python_reads(kind: str, text: str) -> bool:
    try:
        address = ipaddress.ip_address(text) if kind == "ipvanyaddress" else ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return getattr(address, "scope_id", None) is None  # no zone: hypic never writes one


@pytest.mark.parametrize("fmt", ["ipv6", "ipvanyaddress"])
def test_an_ip_format_reads_addresses_as_python_s_ipaddress_does(fmt: str) -> None:
    """Random texts built from address pieces (groups, "::", dotted quads, bad octets): the format
    accepts exactly those Python reads as an address (pydantic's IPv6Address and IPvAnyAddress are it)."""
    rng, read = random.Random(7), 0
    for _ in range(4000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 14)))
        ok = _python_reads(fmt, text)
        read += ok
        assert _matches({"type": "string", "format": fmt}, json.dumps(text)) == ok, text
    assert read > 30  # the draw reaches addresses, not only garbage
    for text in ("::", "::1", "1::", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8", "1:2:3:4:5:6:7:8", "::ffff:1.2.3.4",
                 "1:2:3:4:5:6:1.2.3.4", "FE80::a:1"):
        assert _matches({"type": "string", "format": fmt}, json.dumps(text)), text
    for text in ("::1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::8", "1::2::3", "1:2:3:4:5:6:7", "12345::", "::1.2.3",
                 "::01.2.3.4", "1:2:3:4:5:6:7:1.2.3.4", "fe80::1%eth0", ":1::", "1::2:"):
        assert not _matches({"type": "string", "format": fmt}, json.dumps(text)), text
    for _ in range(3000):  # addresses shaped at random: 0–9 groups, a run compressed or not, a dotted tail
        groups = [format(rng.randrange(1 << rng.choice([4, 16])), rng.choice("xX")) for _ in range(rng.randint(0, 9))]
        if groups and rng.random() < 0.3:
            groups[-1] = ".".join(str(rng.randrange(256)) for _ in range(4))
        if rng.random() < 0.7:
            at = rng.randint(0, len(groups))
            text = ":".join(groups[:at]) + "::" + ":".join(groups[at:])
        else:
            text = ":".join(groups)
        assert _matches({"type": "string", "format": fmt}, json.dumps(text)) == _python_reads(fmt, text), text
    assert _matches({"type": "string", "format": "ipvanyaddress"}, '"10.0.0.1"')
    assert not _matches({"type": "string", "format": "ipv6"}, '"10.0.0.1"')


def test_every_duration_pydantic_writes_is_one_the_format_reads_and_pydantic_reads_every_one_it_accepts() -> None:
    timedelta = TypeAdapter(datetime.timedelta)
    schema = timedelta.json_schema()
    assert schema == {"type": "string", "format": "duration"}
    rng = random.Random(3)
    for _ in range(1500):  # pydantic's own output: years past 365 days, fractions, signs
        d = datetime.timedelta(days=rng.choice([0, 1, rng.randint(0, 999_998)]), seconds=rng.randint(0, 86_399),
                               microseconds=rng.choice([0, rng.randint(0, 999_999)]))
        text = timedelta.dump_json(-d if rng.random() < 0.3 else d).decode()
        assert _matches(schema, text), text
    pieces = ["P", "T", "1", "12", "0", "1234567", ".5", ".", "D", "H", "M", "S", "Y", "-", "W"]
    read = 0
    for _ in range(12000):
        text = rng.choice(["P", "-P", "PT", ""]) + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
        if _matches(schema, json.dumps(text)):
            read += 1
            timedelta.validate_json(json.dumps(text))  # raises where pydantic refuses it
    assert read > 30
    for text in ("P", "PT", "P1DT", "PT99999999H", "P1D1H", "PT.5S", "1:02:03"):  # refused by pydantic or outside
        assert not _matches(schema, json.dumps(text)), text


def _host_name(text: str) -> bool:
    """RFC 1123's host name read directly: dot-separated labels of 1–63 ASCII letters, digits and
    hyphens, none first or last in a label, 253 characters at most."""
    return len(text) <= 253 and all(
        0 < len(label) <= 63 and label[0] != "-" and label[-1] != "-"
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label) for label in text.split("."))


def test_every_host_name_the_format_accepts_is_one_rfc_1123_allows() -> None:
    """Random texts of label pieces: every one the format accepts is a host name (the format is the
    subset of up to four labels of at most 62 characters), and those of that shape are all accepted."""
    schema, rng, read = {"type": "string", "format": "hostname"}, random.Random(11), 0
    pieces = ["a", "Z", "0", "-", ".", "ab", "x" * 30, "é", "_", ""]
    for _ in range(4000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        ok = _matches(schema, json.dumps(text))
        if ok:
            read += 1
            assert _host_name(text), text
        elif _host_name(text) and text.count(".") <= 3 and all(len(label) <= 62 for label in text.split(".")):
            raise AssertionError(f"refused a host name of the subset: {text!r}")
    assert read > 100
    assert _matches(schema, '"api.example.com"') and not _matches(schema, '"-a.com"')
    assert not _matches(schema, json.dumps("a" * 63))  # one past the subset's label


def test_bytes_under_max_length_are_ascii_so_that_characters_count_as_pydantic_s_bytes() -> None:
    schema = TypeAdapter(Annotated[bytes, Field(max_length=4)]).json_schema()
    assert _matches(schema, '"ab c"') and not _matches(schema, '"éé"')  # 2 characters, 4 bytes: refused anyway
    assert _matches({"type": "string", "format": "binary"}, '"ééé"')  # unbounded: any string


TYPES = {
    "IPv6Address": (ipaddress.IPv6Address, 80),
    "IPvAnyAddress": (IPvAnyAddress, 80),
    "timedelta": (datetime.timedelta, 80),
    "bytes under max_length": (Annotated[bytes, Field(max_length=6)], 40),
    "Path": (pathlib.Path, 200),
    "SecretStr": (SecretStr, 200),
}


@pytest.mark.parametrize("name", TYPES)
def test_draws_under_the_mask_are_values_pydantic_reads(vocab, name: str) -> None:  # noqa: F811 — the fixture
    """A pydantic type's own schema compiles, and random draws under its mask are texts its
    validator accepts (bytes under ``max_length``, which pydantic counts in UTF-8 bytes, too)."""
    kind, steps = TYPES[name]
    adapter = TypeAdapter(kind)
    schema = adapter.json_schema()
    assert compile_schema(schema) is not None
    seen = set()
    for seed in range(12):
        text = _written(vocab, schema, random.Random(seed), steps, closer=2000.0).decode()  # free strings end
        adapter.validate_json(text)
        seen.add(text)
    assert len(seen) > 6, seen
