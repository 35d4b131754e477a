"""A mistake in a scenario or fake-NVML file is reported as ``FILE:LINE: field: message``.

These files are written by hand (``gpusteward simulate FILE``, ``demo --scenario FILE``,
``collect nvml --fake-nvml FILE``), so each error must point at the line to fix, as
the policy file's do; the CLI side (exit status, no traceback) is in tests/test_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.sandbox.nvml_fake import FakeNvml
from gpusteward.sandbox.simulator import scenario as scenarios

GOOD = """\
name: tiny
duration_s: 600
nodes:
  - prefix: a100
    count: 1
users: [ada]
workloads:
  - group: train
    phases:
      - util: [80, 90]
"""


def errors(tmp_path: Path, text: str | bytes) -> list[str]:
    path = tmp_path / "world.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(scenarios.ScenarioError) as caught:
        scenarios.load(str(path))
    return [line.removeprefix(f"{path}:") for line in caught.value.lines()]


def test_the_good_file_loads(tmp_path: Path) -> None:
    """The control: the files below are this one with one mistake each."""
    path = tmp_path / "world.yaml"
    path.write_text(GOOD)
    assert scenarios.load(str(path)).workloads[0].phases[0].util == (80, 90)


def test_a_missing_file_says_it_cannot_be_read(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(scenarios.ScenarioError) as caught:
        scenarios.load(str(path))
    (line,) = caught.value.lines()
    assert line.startswith(f"{path}:?: <top>: cannot read: ") and "No such file" in line


def test_a_yaml_syntax_error_names_its_line(tmp_path: Path) -> None:
    broken = GOOD.replace("users: [ada]", "users: [ada")
    (line,) = errors(tmp_path, broken)
    assert line.startswith("7: <top>: not valid YAML: ")


def test_an_empty_file_says_what_a_scenario_needs(tmp_path: Path) -> None:
    assert errors(tmp_path, "# nothing yet\n") == [
        "1: <top>: empty: a scenario needs at least name, duration_s, nodes, users"]


def test_an_unknown_field_is_refused_at_its_line(tmp_path: Path) -> None:
    misspelt = GOOD.replace("    count: 1", "    cuont: 1")
    assert errors(tmp_path, misspelt) == [
        "4: nodes.0.count: Field required",
        "5: nodes.0.cuont: Extra inputs are not permitted",
    ]


def test_a_wrong_type_names_the_field_and_its_line(tmp_path: Path) -> None:
    wrong = GOOD.replace("duration_s: 600", "duration_s: ten minutes").replace(
        "util: [80, 90]", "util: high")
    assert errors(tmp_path, wrong) == [
        "2: duration_s: Input should be a valid number, unable to parse string as a number",
        "10: workloads.0.phases.0.util: Input should be a valid tuple",
    ]


def test_a_key_given_twice_is_refused_at_the_repeat(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys silently: the first would be ignored."""
    twice = GOOD.replace("duration_s: 600", "duration_s: 600\nduration_s: 60")
    assert errors(tmp_path, twice) == ["3: duration_s: duplicate key, first given on line 2"]


def test_a_file_that_is_not_utf8_names_the_line_of_the_first_bad_byte(
        tmp_path: Path) -> None:
    latin1 = GOOD.replace("[ada]", "[adé]").encode("latin-1")
    (line,) = errors(tmp_path, latin1)
    assert line.startswith("6: <top>: not UTF-8 text: invalid continuation byte (byte 0xe9)")


def test_a_nul_byte_is_a_yaml_error_with_its_line(tmp_path: Path) -> None:
    (line,) = errors(tmp_path, GOOD.replace("ada", "a\0da"))
    assert line.startswith("6: <top>: not valid YAML: ")


def test_an_unknown_builtin_lists_the_built_in_ones() -> None:
    with pytest.raises(scenarios.ScenarioError) as caught:
        scenarios.load("eight-h100")
    (line,) = caught.value.lines()
    assert line.startswith("eight-h100:?: <top>: neither a file nor a built-in scenario; "
                           "built-in ones: ") and "eight-a100" in line


@pytest.mark.parametrize("name", scenarios.builtin_names())
def test_every_built_in_scenario_has_only_known_fields(name: str) -> None:
    assert scenarios.load(name).name


FAKE_NVML = """\
driver_version: "550.54.15"
gpus:
  - uuid: GPU-0
    name: NVIDIA A100-SXM4-80GB
  - uuid: GPU-1
    name: NVIDIA A100-SXM4-80GB
    temp: 40
"""


def fake_nvml_errors(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "node.yaml"
    path.write_text(text)
    with pytest.raises(scenarios.ScenarioError) as caught:
        FakeNvml.from_yaml(path)
    return [line.removeprefix(f"{path}:") for line in caught.value.lines()]


def test_the_good_fake_nvml_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(FAKE_NVML)
    assert [gpu.temp for gpu in FakeNvml.from_yaml(path).gpus] == [35, 40]


def test_a_missing_fake_nvml_file_says_it_cannot_be_read(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(scenarios.ScenarioError) as caught:
        FakeNvml.from_yaml(path)
    (line,) = caught.value.lines()
    assert line.startswith(f"{path}:?: <top>: cannot read: ")


def test_fake_nvml_syntax_unknown_fields_and_shape_are_located(tmp_path: Path) -> None:
    (syntax,) = fake_nvml_errors(tmp_path, FAKE_NVML.replace("temp: 40", "temp: [40"))
    assert syntax.startswith("8: <top>: not valid YAML: ")
    assert fake_nvml_errors(tmp_path, FAKE_NVML.replace("temp: 40", "tempp: 40")) == [
        "5: gpus.1: fake GPU 1: unknown keys ['tempp']"]
    assert fake_nvml_errors(tmp_path, FAKE_NVML.replace("gpus:", "gpu:")) == [
        "2: gpu: unknown field; known: driver_version, init_error, gpus, faults"]
    assert fake_nvml_errors(tmp_path, "") == [
        "1: <top>: a fake NVML description is a mapping of driver_version, init_error, gpus, "
        "faults"]
