"""cumulus.methods(): the registry as the CLI prints it, with typed defaults inside their ranges."""

import re
import subprocess

import cumulus

# The methods docs/architecture.md lists; a registry may hold more.
DOCUMENTED = {"dense", "oracle_topk", "oracle_topp", "streaming", "quest", "tactic", "psa", "lfps", "sketch_topp",
              "flexprefill"}


def test_methods_lists_the_documented_methods():
    ms = {m.name: m for m in cumulus.methods()}
    assert DOCUMENTED <= set(ms)
    assert ms["dense"].decodes and ms["dense"].prefills
    assert ms["flexprefill"].prefills and not ms["flexprefill"].decodes
    assert ms["oracle_topp"].target_param == "p"
    assert ms["quest"].budget_param == "budget"


def test_every_default_is_typed_and_in_its_range():
    types = {"int": int, "float": float, "bool": bool, "str": str, "choice": str}
    for m in cumulus.methods():
        for p in m.params:
            assert type(p.default) is types[p.type], (m.name, p.name, p.default)
            if p.min is not None:
                assert p.default > p.min if p.min_exclusive else p.default >= p.min, (m.name, p.name)
            if p.max is not None:
                assert p.default < p.max if p.max_exclusive else p.default <= p.max, (m.name, p.name)
            assert (p.type == "choice") == bool(p.choices), (m.name, p.name, p.choices)
            if p.choices:
                assert p.default in p.choices, (m.name, p.name, p.default, p.choices)
            assert p.help, (m.name, p.name)
    p = next(p for p in next(m for m in cumulus.methods() if m.name == "oracle_topp").params if p.name == "p")
    assert (p.min, p.max, p.min_exclusive, p.default) == (0.0, 1.0, True, 0.9)
    rest = next(p for p in next(m for m in cumulus.methods() if m.name == "sketch_topp").params if p.name == "rest")
    assert rest.type == "choice" and rest.default == "mean" and "none" in rest.choices


def test_methods_match_the_cli(cli):
    """Every method and parameter `cumulus methods` prints, with the same default."""
    out = subprocess.run([str(cli), "methods"], check=True, capture_output=True, text=True).stdout
    cli_methods, current = {}, None
    for line in out.splitlines():
        head = re.match(r"^(\w+)\s+(decode|prefill)", line)
        if head:
            current = cli_methods.setdefault(head.group(1), {})
            continue
        param = re.match(r"^\s+--(?:prefill-)?param (\w+)=(\S*)", line)
        if param and current is not None:
            current[param.group(1)] = param.group(2)
    assert set(cli_methods) == {m.name for m in cumulus.methods()}
    for m in cumulus.methods():
        got = {p.name: p.default for p in m.params}
        assert set(got) == set(cli_methods[m.name]), m.name
        for name, text in cli_methods[m.name].items():
            value = got[name]
            if isinstance(value, bool):
                assert text in (("true", "1") if value else ("false", "0")), (m.name, name)
            elif isinstance(value, (int, float)):
                assert value == float(text), (m.name, name)
            else:
                assert value == text, (m.name, name)
