"""Code reward sources: code_tests, code_reshaped (staged credit), verrpo_weighted_tests (stateful weights)."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest

from postrl import registry, stages
from postrl.errors import ConfigError
from postrl.stages import StepEnd
from postrl.rewards.code import (VeRPOWeightedTests, code_reshaped, code_tests, extract_code, last_results,
                                 lint_issues)
from postrl.rewards.core import score_batch

TESTS = "def test_a():\n    assert add(1, 2) == 3\n\n\ndef test_b():\n    assert add(2, 2) == 4\n"
GOOD = "def add(a, b):\n    return a + b\n"


def fence(code: str) -> str:
    return f"Here you go:\n```python\n{code}```\nDone."


def test_extract_code():
    assert extract_code(fence(GOOD)) == GOOD
    two = "```python\nx = 1\n```\ntext\n```py\ny = 2\n```"
    assert extract_code(two) == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("```python\nx = 1\n```\n```bash\nls\n```") == "x = 1\n"
    assert extract_code("```python\ntruncated = True\n") == "truncated = True\n"
    assert extract_code(GOOD) == GOOD


def test_lint_issues():
    code = ("import os\nimport sys\nfrom math import *\n\ndef f(x=[]):\n    try:\n        return x == None\n"
            "    except:\n        return sys.argv\n")
    issues = lint_issues(code)
    kinds = " | ".join(issues)
    for word in ("unused import os", "wildcard import", "mutable default", "comparison to None", "bare except"):
        assert word in kinds
    assert len(issues) == 5
    assert lint_issues(GOOD) == []


def test_code_reshaped_stages_hand_computed():
    comps = [
        fence(GOOD),                                                       # everything: 1.0
        fence("import os\n\ndef add(a, b):\n    return 3\n"),              # P C R=1 T=1/2 L=1/2
        fence("undefined_name\n\ndef add(a, b):\n    return a + b\n"),    # P, not loaded: 0.05 + 0.05 L
        fence("def add(a, b:\n    return a\n"),                            # syntax error: 0
        fence("import sys\nsys.exit(0)\n"),                                # exit while loading: 0
        fence("def add(a, b):\n    raise ValueError('no')\n"),             # loads, every test raises: R=0
    ]
    got = code_reshaped(None, comps, [TESTS] * len(comps), timeout=8.0)
    want = [1.0, 0.05 + 0.05 + 0.1 + 0.75 * 0.5 + 0.05 * 0.5, 0.05 + 0.05, 0.0, 0.0, 0.05 + 0.05 + 0.05]
    assert got == pytest.approx(want)
    w = dict(w_parse=0.0, w_compile=0.0, w_run=0.5, w_tests=0.5, w_lint=0.0)
    assert code_reshaped(None, comps[:2], [TESTS] * 2, timeout=8.0, **w) == pytest.approx([1.0, 0.5 + 0.25])
    with pytest.raises(ConfigError, match=r"^rewards.0.w_run: expected a value >= 0, got -1.0$"):
        stages.check_params("reward", "code_reshaped", {"w_run": -1.0}, "rewards.0")
    with pytest.raises(ConfigError, match=r"^rewards.0.w_run: expected a number, got True$"):
        stages.check_params("reward", "code_reshaped", {"w_run": True}, "rewards.0")


def test_verrpo_weights_by_running_difficulty():
    r = VeRPOWeightedTests(pass_bonus=0.5)
    tests = ["assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 0\n"] * 4
    comps = [fence(GOOD), fence("def add(a, b):\n    return a - b\n"),
             fence("def add(a, b):\n    return a + b if a < 2 else 0\n"), fence("import sys\nsys.exit(0)\n")]
    got = r(None, comps, tests=tests)
    assert r.state_dict()["stats"] == {}  # a call reads the statistics with its batch merged in; the step keeps it
    r.observe(comps, {"tests": tests})
    assert r.state_dict()["stats"] == {}  # recorded, not applied
    stages.end_step([stages.Stage("reward", "verrpo_weighted_tests", r, {}, ())], StepEnd())
    # passes per test: t1 2/4, t2 1/4, t3 3/4 -> p = (passes + 0.5) / (4 + 1) -> w = 1 - p = 0.5, 0.7, 0.3
    w = [0.5, 0.7, 0.3]
    want = [1.0, 0.5 * (0.3 / 1.5), 0.5 * ((0.5 + 0.3) / 1.5), 0.0]
    assert got == pytest.approx(want)
    assert sum(w) == pytest.approx(1.5)
    st = r.state_dict()
    assert json.loads(json.dumps(st)) == st
    assert sorted(v for v in st["stats"].values()) == [[1.0, 4.0], [2.0, 4.0], [3.0, 4.0]]
    # statistics persist: the same problem again, only the correct program -> every test's rate rises
    again = r(None, comps[:1], tests=tests[:1])
    r.observe(comps[:1], {"tests": tests[:1]})
    stages.end_step([stages.Stage("reward", "verrpo_weighted_tests", r, {}, ())], StepEnd())
    assert again == pytest.approx([1.0])
    assert sorted(v for v in r.state_dict()["stats"].values()) == [[2.0, 5.0], [3.0, 5.0], [4.0, 5.0]]
    # restore into a fresh instance and through pickle
    fresh = VeRPOWeightedTests(pass_bonus=0.5)
    fresh.load_state_dict(st)
    assert fresh.state_dict()["stats"] == st["stats"]
    clone = pickle.loads(pickle.dumps(r))
    assert clone.state_dict() == r.state_dict()
    with pytest.raises(ConfigError, match="not a state_dict"):
        fresh.load_state_dict({"stats": 3})


def test_verrpo_ema_and_bad_params():
    r = VeRPOWeightedTests(momentum=0.5, pass_bonus=0.0)
    r._update({"k": [1, 1, 0, 0]})  # rate 0.5: p = 0.5 * 0.5 + 0.5 * 0.5
    assert r.pass_rate("k") == pytest.approx(0.5)
    r._update({"k": [1, 1]})
    assert r.pass_rate("k") == pytest.approx(0.75)
    with pytest.raises(ConfigError, match=r"^reward.pass_bonus: expected a value >= 0 and <= 1, got 2$"):
        stages.build("reward", "verrpo_weighted_tests", {"pass_bonus": 2})
    with pytest.raises(ConfigError, match=r"^reward.momentum: expected a value >= 0 and < 1, got 1.0$"):
        stages.build("reward", "verrpo_weighted_tests", {"momentum": 1.0})
    with pytest.raises(ConfigError, match=r"^rewards.0.isolation: expected 'auto', 'bwrap', 'namespaces' or "):
        stages.check_params("reward", "code_tests", {"isolation": "docker"}, "rewards.0")


def test_registered_sources_work_through_score_batch():
    assert {"code_tests", "code_reshaped", "verrpo_weighted_tests"} <= set(registry.names("reward"))
    stages.check_params("reward", "verrpo_weighted_tests", {"pass_bonus": 0.2, "timeout": 5}, "rewards.0")
    with pytest.raises(ConfigError, match="valid: pass_bonus"):
        stages.check_params("reward", "verrpo_weighted_tests", {"bonus": 0.2}, "rewards.0")
    specs = [SimpleNamespace(name="code_tests", params={"timeout": 8.0}),
             SimpleNamespace(name="verrpo_weighted_tests", params={"pass_bonus": 0.5, "timeout": 8.0})]
    built = stages.build_all("reward", specs)
    comps = [fence(GOOD), fence("def add(a, b):\n    return 3\n")]
    cols = {"tests": [TESTS, TESTS], "group_ids": [0, 0]}
    out = score_batch(["p", "p"], comps, cols, specs, built=[(st.fn, st.params) for st in built])
    assert out.failures == {}
    # verrpo: t_a passed by both (p = 2.5/3, w = 1/6), t_b by one (p = 1.5/3, w = 1/2)
    assert out.matrix[:, 0].tolist() == pytest.approx([1.0, 0.5])
    assert out.matrix[:, 1].tolist() == pytest.approx([1.0, 0.5 * (1 / 6) / (1 / 6 + 1 / 2)])
    verrpo = built[1]
    assert verrpo.state_dict()["stats"] == {}  # a call changes no state
    verrpo.observe({"completions": comps, "columns": cols})
    stages.end_step(built, StepEnd())
    assert sum(v[1] for v in verrpo.state_dict()["stats"].values()) == 4  # 2 completions x 2 tests, kept


def test_rows_without_tests_are_none_and_results_are_inspectable():
    assert code_tests(None, [fence(GOOD), fence(GOOD)], [TESTS, None], timeout=8.0) == [1.0, None]
    res = last_results()
    assert res[0].status == "ok" and res[1] is None


# ------------------------------------------------------------------------------------------------ forging a pass
# Three wrong solutions that scored 3/3 when the tests ran inside the program's interpreter. The tests now run in
# a checker process; the program answers from its own process with plain data only.
AREA_TESTS = ("def test_1():\n    assert abs(area(1) - 3.14159) < 1e-3\n\n"
              "def test_2():\n    assert abs(area(2) - 12.56637) < 1e-3\n\n"
              "def test_3():\n    assert isinstance(area(3), float)\n")
ADD3 = TESTS + "\n\ndef test_c():\n    assert add(5, 5) == 10\n"
REBIND_BUILTINS = ("exec('import builtins\\nbuiltins.abs = lambda x: 0\\nbuiltins.isinstance = lambda *a: True')\n"
                   "def area(r):\n    return 0\n")
FORGE_REPORT = """
import os, sys
f = sys._getframe()
while f is not None and not ('send' in f.f_locals and 'units' in f.f_locals):
    f = f.f_back
if f is not None:
    send, units = f.f_locals['send'], f.f_locals['units']
    send(b'L')
    for i in range(len(units)):
        send(b'R', i, b'pass', b'')
    send(b'D')
    os._exit(0)
g = sys._getframe()
while g is not None:  # the program's own process: whatever answer function it finds, it can only lie about itself
    for v in list(g.f_locals.values()):
        if callable(v) and getattr(v, '__name__', '') == 'send':
            try:
                v(('L', [('add', ('i', '0x3'))]))
            except Exception:
                pass
    g = g.f_back
def add(a, b):
    return 0
"""
EQUAL_TO_ANYTHING = ("class F(float):\n    def __eq__(self, o):\n        return True\n    __ne__ = lambda s, o: False\n"
                     "    __hash__ = float.__hash__\n"
                     "def add(a, b):\n    return F(0)\n")


TRUTHY = "class T:\n    def __bool__(self):\n        return True\ndef is_even(n):\n    return T()\n"
EVEN_TESTS = "assert is_even(2)\nassert is_even(4)\nassert is_even(10)\n"


@pytest.mark.parametrize("name,code,tests", [("rebind_builtins", REBIND_BUILTINS, AREA_TESTS),
                                             ("forge_report", FORGE_REPORT, ADD3),
                                             ("equal_to_anything", EQUAL_TO_ANYTHING, ADD3),
                                             ("always_truthy", TRUTHY, EVEN_TESTS)])
def test_wrong_solutions_cannot_forge_passing_tests(name, code, tests):
    assert code_tests(None, [fence(code)], [tests], timeout=8.0) == [0.0], last_results()[0]
    r = last_results()[0]
    assert r.passed == 0 and r.total == 3


def test_tests_reach_the_program_by_name_module_and_object():
    """Top-level names, `from solution import ...`, class instances and their methods work from the checker; an
    object result equals only itself and a value comes back with its exact type."""
    code = ("class Solution:\n    def two_sum(self, xs, t):\n        return [0, 1] if xs[0] + xs[1] == t else []\n"
            "def pair(a):\n    return (a, [a])\n"
            "def gen(n):\n    return (i * i for i in range(n))\n")
    tests = ("from solution import pair\n\n"
             "def test_obj():\n    assert Solution().two_sum([2, 7, 11], 9) == [0, 1]\n\n"
             "def test_tuple():\n    assert pair(3) == (3, [3]) and type(pair(3)) is tuple\n\n"
             "def test_iter():\n    assert list(gen(4)) == [0, 1, 4, 9]\n\n"
             "def test_object_is_not_data():\n    assert Solution() != Solution()\n\n"
             "def test_wrong_type_fails():\n    assert pair(3) == [3, [3]]\n")
    assert code_tests(None, [fence(code)], [tests], timeout=8.0) == [pytest.approx(4 / 5)]
    assert [t["status"] for t in last_results()[0].tests] == ["pass"] * 4 + ["fail"]


def test_program_imports_and_big_tables_reach_the_tests_without_trusting_the_program():
    """A module the program imported is the checker's own copy (rebinding math.sqrt in the program changes nothing
    the test sees); a big table stays in the program and is read item by item."""
    liar = "import math\nmath.sqrt = lambda x: 0\ndef root2():\n    return 0\n"
    tests = "def test_a():\n    assert abs(root2() - math.sqrt(2)) < 1e-9\n"
    assert code_tests(None, [fence(liar)], [tests], timeout=8.0) == [0.0]
    honest = "import math\ndef root2():\n    return math.sqrt(2)\n"
    assert code_tests(None, [fence(honest)], [tests], timeout=8.0) == [1.0]
    table = "SQUARES = [i * i for i in range(100000)]\ndef sq(i):\n    return SQUARES[i]\n"
    tests = ("def test_a():\n    assert sq(300) == 90000 and SQUARES[7] == 49 and len(SQUARES) == 100000\n"
             "def test_b():\n    assert 81 in SQUARES\n")
    assert code_tests(None, [fence(table)], [tests], timeout=8.0) == [1.0], last_results()[0]
