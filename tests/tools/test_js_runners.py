"""JavaScript test runners for test_runner, without Docker: which runner a test script names (and what it
must not run), the command that runs a file or one test, and the runners' reports read back into test ids."""

from __future__ import annotations

import json
import re

import pytest

from m3_agent.tools.js_runners import (JEST_BY_PATH, ScriptError, ScriptPlan, read_cases, repository_note,
                                       run_command, script_plan, tap_cases)
from m3_agent.tools.junit import FAILED, PASSED, SKIPPED


@pytest.mark.parametrize(("script", "runner", "before"), [
    ("xo && ava && tsd", "ava", []),  # sindresorhus/slugify: lint and type tests are not the tests
    ("tsc && node --test dist/", "node", ["tsc"]),  # a build first
    ("tsc --noEmit && vitest run", "vitest", []),  # a type check only
    ("npm run lint && npm run build && npm run test:unit", "jest", ["npm run build"]),
    ("cross-env NODE_ENV=test c8 --reporter=lcov mocha 'test/**/*.spec.js'", "mocha", []),
    ("node --experimental-vm-modules node_modules/jest/bin/jest.js", "jest", []),
    ("tsx --test test/*.test.ts", "node", []),
    ("tap", "tap", []),
    ("pnpm lint && pnpm test:types && pnpm vitest run", "vitest", []),  # unjs/defu: `pnpm vitest` is a binary
    ("npm-run-all --silent typecheck lint mocha", "mocha", []),  # developit/mitt: scripts by name
])
def test_the_runner_the_test_script_names_runs_and_its_checks_do_not(script, runner, before):
    scripts = {"test": script, "lint": "eslint .", "build": "tsc -p .", "test:unit": "jest --coverage",
               "test:types": "tsc --noEmit", "typecheck": "tsc --noEmit", "mocha": "mocha test/*.ts"}
    plan = script_plan(scripts)
    assert (plan.runner, plan.before) == (runner, before)


def test_npm_runs_pretest_first_so_it_runs_unless_it_only_lints():
    plan = script_plan({"test": "node --test dist/test/*.js", "pretest": "npm run build", "build": "tsc"})
    assert plan.before == ["npm run build"]
    assert script_plan({"test": "jest", "pretest": "eslint ."}).before == []


def test_environment_assignments_of_the_script_stay_with_the_runner():
    plan = script_plan({"test": "cross-env NODE_ENV=test TZ=UTC mocha"})
    assert run_command(plan, [], None, "/tmp/r.xml").startswith("NODE_ENV=test TZ=UTC mocha ")


@pytest.mark.parametrize("script", ["playwright test", "karma start karma.conf.js", "npx cypress run"])
def test_browser_runners_are_refused_in_one_line(script):
    with pytest.raises(ScriptError, match="browser tests are not supported here") as e:
        script_plan({"test": script})
    assert "\n" not in str(e.value)


def test_a_script_with_no_runner_says_so_and_a_named_framework_runs_anyway():
    with pytest.raises(ScriptError, match="names no test runner"):
        script_plan({"test": "echo \"Error: no test specified\" && exit 1"})
    with pytest.raises(ScriptError, match="no `test` script"):
        script_plan({})
    assert script_plan({}, framework="mocha") == ScriptPlan("mocha", ["mocha"])
    assert script_plan({"test": "jest --coverage"}, framework="jest").argv == ["jest", "--coverage"]


def test_a_file_replaces_the_scripts_own_paths_and_a_title_selects_one_test():
    plan = script_plan({"test": "mocha --timeout 5000 'test/**/*.js'"})
    command = run_command(plan, ["test/a.spec.js"], "group > does x", "/tmp/r.xml")
    assert "'test/**/*.js'" not in command and command.endswith("test/a.spec.js")
    assert "--reporter xunit --reporter-option output=/tmp/r.xml" in command and "--timeout 5000" in command
    assert "'--grep=^group\\ does\\ x$'" in command
    express = run_command(script_plan({"test": "mocha --require test/support/env --check-leaks test/ test/acc/"}),
                          ["test/Router.js"], None, "/tmp/r.xml")  # expressjs/express
    assert express.startswith("mocha --require test/support/env --check-leaks --reporter xunit")
    assert express.endswith(" test/Router.js") and "test/acc/" not in express
    jest = run_command(script_plan({"test": "jest"}), ["src/a.test.ts"], None, "/tmp/r.json")
    assert jest == "jest --json --outputFile=/tmp/r.json src/a.test.ts" + JEST_BY_PATH
    # A describe's test, or Jest 19's id of it (its report has no describe titles): the full name ends with it.
    one = run_command(script_plan({"test": "jest"}), ["a.test.js"], "add > adds one", "/tmp/r.json")
    assert "'--testNamePattern=(^| )add\\ adds\\ one$'" in one, one
    pattern = re.compile(one.split("--testNamePattern=")[1].split("'")[0].replace("\\ ", " "))
    assert pattern.search("add adds one") and pattern.search("math add adds one")
    assert not pattern.search("add adds one more") and not pattern.search("subadd adds one")
    vitest = run_command(script_plan({"test": "vitest"}), [], None, "/tmp/r.json")
    assert vitest.startswith("vitest run ") and "--outputFile.json=/tmp/r.json" in vitest
    node = run_command(script_plan({"test": "tsc && node --test dist/"}), [], "a > b", "/tmp/r.xml")
    assert node.startswith("tsc && node --test '--test-name-pattern=^b$' --test-reporter=spec")
    assert "dist/" in node and "--test-reporter-destination=/tmp/r.xml" in node


JEST_REPORT = {"testResults": [
    {"name": "/workspace/packages/a/test/calc.test.js", "status": "failed", "message": "", "assertionResults": [
        {"ancestorTitles": ["add"], "title": "adds", "status": "failed",
         "failureMessages": ["Error: expect(received).toBe(expected)\n\nExpected: 5\nReceived: -1\n"
                             "    at Object.toBe (/workspace/packages/a/test/calc.test.js:3:54)\n"
                             "    at run (/opt/m3-agent/node-packages/node_modules/jest-circus/build/run.js:1:1)"]},
        {"ancestorTitles": ["add"], "title": "zero", "status": "passed", "failureMessages": []},
        {"ancestorTitles": [], "title": "later", "status": "todo", "failureMessages": []}]},
    {"name": "/workspace/packages/a/test/broken.test.js", "status": "failed", "assertionResults": [],
     "message": "  ● Test suite failed to run\n\n    Cannot find module './nope' from 'test/broken.test.js'"}]}


def test_jest_and_vitest_reports_give_file_and_full_title_ids_relative_to_the_repository():
    cases = read_cases("jest", json.dumps(JEST_REPORT), "", "packages/a", "/workspace")
    assert [(c.id, c.status) for c in cases] == [
        ("packages/a/test/calc.test.js::add > adds", FAILED), ("packages/a/test/calc.test.js::add > zero", PASSED),
        ("packages/a/test/calc.test.js::later", SKIPPED), ("packages/a/test/broken.test.js", "ERROR")]
    assert cases[0].message.startswith("Error: expect(received).toBe(expected)")
    assert "jest-circus" not in cases[0].detail and "calc.test.js:3:54" in cases[0].detail
    assert "Cannot find module './nope'" in cases[3].message


MOCHA_XUNIT = """<testsuite name="Mocha Tests" tests="2" failures="1" errors="0" skipped="0">
<testcase classname="strings" name="upper" time="0"/>
<testcase classname="strings nested" name="strings nested broken" time="0" file="/workspace/test/s.spec.js">
<failure message="Expected values to be strictly equal:&#10;&#10;1 !== 2&#10;">AssertionError: 1 !== 2
    at Context.&lt;anonymous&gt; (test/s.spec.js:4:33)</failure></testcase>
</testsuite>"""

NODE_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites>
  <testsuite name="numbers" time="0.002" disabled="0" errors="0" tests="2" failures="1" skipped="0" hostname="x">
    <testcase name="adds" time="0.000" classname="test" file="/workspace/node/basic.test.mjs"/>
    <testcase name="breaks" time="0.001" classname="test" file="/workspace/node/basic.test.mjs" failure="x">
      <failure type="testCodeFailure" message="Expected values to be strictly equal:&#10;&#10;2 !== 3&#10;">
[Error [ERR_TEST_FAILURE]: Expected values to be strictly equal:
2 !== 3
]</failure>
    </testcase>
  </testsuite>
  <testcase name="top level" time="0.000" classname="test" file="/workspace/node/basic.test.mjs"/>
</testsuites>"""


def test_mocha_and_node_junit_reports_give_full_titles():
    mocha = read_cases("mocha", MOCHA_XUNIT, "", ".", "/workspace")
    assert [(c.id, c.status) for c in mocha] == [("strings > upper", PASSED),
                                                 ("test/s.spec.js::strings nested > broken", FAILED)]
    node = read_cases("node", NODE_JUNIT.replace(' file="/workspace/node/basic.test.mjs"', ""), "", "node",
                      "/workspace", "basic.test.mjs")  # node 22 leaves the file out: the run's one file
    assert [(c.id, c.status) for c in node] == [("node/basic.test.mjs::numbers > adds", PASSED),
                                                ("node/basic.test.mjs::numbers > breaks", FAILED),
                                                ("node/basic.test.mjs::top level", PASSED)]
    assert node[1].message.startswith("Expected values to be strictly equal")
    assert read_cases("node", NODE_JUNIT, "", ".", "/workspace")[0].id == "node/basic.test.mjs::numbers > adds"


AVA_TAP = """TAP version 13
ok 1 - basic.test › ava passes
not ok 2 - basic.test › ava fails
  ---
    name: AssertionError
    message: Difference (- actual, + expected)
  ...
ok 3 - basic.test › later # SKIP
1..3
"""

NESTED_TAP = """TAP version 14
# Subtest: test/a.js
    # Subtest: group
        ok 1 - works
        not ok 2 - fails
        1..2
    not ok 1 - group
    1..1
not ok 1 - test/a.js
1..1
"""


def test_tap_points_are_the_tests_and_their_subtests_lead_the_titles():
    assert [(c.id, c.status) for c in tap_cases(AVA_TAP)] == [
        ("basic.test › ava passes", PASSED), ("basic.test › ava fails", FAILED), ("basic.test › later", SKIPPED)]
    assert "Difference" in tap_cases(AVA_TAP)[1].detail
    assert [(c.id, c.status) for c in tap_cases(NESTED_TAP)] == [
        ("test/a.js > group > works", PASSED), ("test/a.js > group > fails", FAILED)]


def test_the_model_is_told_the_language_and_runner_of_a_javascript_repository_only(tmp_path):
    assert repository_note(tmp_path) == ""
    (tmp_path / "package.json").write_text(json.dumps({"scripts": {"test": "xo && ava"}}))
    note = repository_note(tmp_path)
    assert "This repository is JavaScript" in note and "with ava" in note
    (tmp_path / "tsconfig.json").write_text("{}")
    assert "This repository is TypeScript" in repository_note(tmp_path)


def test_tap_file_subtests_become_the_file_of_the_id_and_its_timings_are_no_part_of_the_title():
    # tap 21's own output for one file of a workspace package (packages/t): each point carries `# time=`.
    tap21 = ("TAP version 14\n# Subtest: test/shared.js\n    # Subtest: numbers\n        ok 1 - doubles\n"
             "        not ok 2 - halves\n        1..2\n    not ok 1 - numbers # time=80.458ms\n    1..1\n"
             "not ok 1 - test/shared.js # time=173.627ms\n1..1\n# { total: 1, pass: 0, fail: 1 }\n")
    cases = read_cases("tap", None, tap21, "packages/t", "/workspace", "test/shared.js")
    assert [(c.id, c.status) for c in cases] == [("packages/t/test/shared.js::numbers > doubles", PASSED),
                                                 ("packages/t/test/shared.js::numbers > halves", FAILED)]


def test_mochas_bare_directory_word_is_replaced_by_the_named_file_and_option_values_stay():
    # mitt's `mocha test`: `test` is a directory with no slash, and ran beside the chosen file.
    mitt = run_command(script_plan({"test": "mocha --timeout 5000 -u bdd test"}), ["test/index_test.ts"], None, "/r")
    assert mitt.startswith("mocha --timeout 5000 -u bdd --reporter xunit") and mitt.endswith(" test/index_test.ts")
    assert " test " not in mitt
