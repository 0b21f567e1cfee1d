"""README.rst and the documentation (docs/) stay true: every Python snippet and every
example command in them runs as written, README renders on its own, and the link check
finds broken links. Building the site itself is ``make docs``, which ``make test`` runs."""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import functools
import itertools
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import ray

from test.conftest import (
    DOC_FILES,
    ROOT,
    doc_blocks,
    run_fresh,
    run_fresh_python,
    start_local_ray,
)

README = (ROOT / "README.rst").read_text()
# Every page, README first: where the example commands are looked up.
DOCS = "\n".join(path.read_text() for path in DOC_FILES)

pytestmark = pytest.mark.timeout(300)


PYTHON = doc_blocks("python")


# Longest a snippet, and an example's or the command line's command, may run.
SNIPPET_S, COMMAND_S = 240, 280


@pytest.fixture
def joined() -> None:
    """This module's local Ray, for the snippets and commands that start no Ray with
    resources of their own (``run()``, a plain ``ray.init()``, the examples): they join it
    through RAY_ADDRESS (``join_ray``), as in a Ray Job (docs/run.rst), instead of each
    starting one, most of a short snippet's time."""
    start_local_ray(4)


def _block(marker: str) -> str:
    (block,) = [b for b in PYTHON if marker in b]
    return block


def test_the_docs_have_the_snippets_this_test_runs():
    assert len(PYTHON) == 20
    for marker in (
        "num_slots=2, callbacks=[print]",
        "torch.tensor(float(hvd.rank()))",
        "hvd.broadcast_optimizer_state(optimizer",
        "max_restarts=2",
        "CheckpointConfig(num_to_keep=2)",
        "RayExecutor(settings",
        "DistributedTrainableCreator(train",
        "min_workers=2, max_workers=4",
        # Run on simulated hosts (test/hosts), with the head's address for HEAD.
        'ray.init(address="auto")',
        'ray.init("ray://HEAD:10001")',
        "torch.cuda.set_device(hvd.local_rank())",
        "set_memory_growth",
        "stall_timeout_s=4",
        'create_settings(name="listed")',
        "trainer = TorchTrainer(",
        "trainer = HorovodTrainer(",
        'print("horovod_ray", result.metrics',
        "get_preemption_info() is not None",
        "validation_config=ValidationConfig(evaluate)",
        'get_dataset_shard("train")',
    ):
        assert _block(marker)
    assert any("ray job submit --address http://HEAD:8265" in b for b in doc_blocks("bash"))


def test_quickstart_run_snippet(joined):
    out = run_fresh_python(_block("num_slots=2, callbacks=[print]"), SNIPPET_S, join_ray=True)
    assert "{'rank': 0, 'size': 2}" in out  # the callback printed rank 0's log


def test_quickstart_torch_snippet(joined):
    # Its assert: 0 + 1 on both ranks.
    run_fresh_python(_block("torch.tensor(float(hvd.rank()))"), SNIPPET_S, join_ray=True)


def test_pytorch_page_snippet(joined):
    # Its assert: in step.
    run_fresh_python(_block("hvd.broadcast_optimizer_state(optimizer"), SNIPPET_S, join_ray=True)


def test_restarts_snippet(joined):
    # Its assert: every rank ran in attempt 1.
    run_fresh_python(_block("max_restarts=2"), SNIPPET_S, join_ray=True)


def test_checkpoints_snippet(joined):
    # Its asserts: resumed.
    out = run_fresh_python(_block("CheckpointConfig(num_to_keep=2)"), SNIPPET_S, join_ray=True)
    assert out.splitlines()[-1] == "4 [3, 4]"


def test_checkpoints_validation_snippet(joined):
    out = run_fresh_python(
        _block("validation_config=ValidationConfig(evaluate)"), SNIPPET_S, join_ray=True
    )
    losses, best = out.strip().splitlines()[-2:]
    assert losses == "[1.5, 0.5, 0.5]"
    assert best.endswith("/validated/checkpoint_000002")  # the oldest of equals, as Ray


def test_data_page_snippet_trains_torch_and_keras_from_one_dataset():
    """It starts its own Ray (4 CPUs: two ranks and room for Ray Data); its asserts: as
    many steps on each rank, one model."""
    out = run_fresh_python(_block('get_dataset_shard("train")'), SNIPPET_S)
    torch_line, keras_line = out.strip().splitlines()[-2:]
    assert torch_line == "train_torch [(100, 3.0), (100, 3.0)]"
    assert keras_line == "train_keras [(10, 3.0), (10, 3.0)]"


def test_cloud_pages_preemption_snippet(joined):
    """Without a drain it trains to the end (test/job/test_multinode.py drains a node)."""
    out = run_fresh_python(_block("get_preemption_info() is not None"), SNIPPET_S, join_ray=True)
    assert out.strip().splitlines()[-1] == "[20, 20]"


def test_the_ray_train_pages_horovod_trainer_script_runs(joined):
    out = run_fresh_python(_block("trainer = HorovodTrainer("), SNIPPET_S, join_ray=True)
    assert out.splitlines()[-1] == "HorovodTrainer 2 True"


def test_the_ray_train_page_runs_both_twins(joined):
    """A TorchTrainer script (Ray Train v2 as installed) and its horovod_ray twin end
    alike: three epochs on two workers. They run side by side (2 of the 4 CPUs each):
    each waits on its own start and stop most of its time. Ray Train v2 leaves a detached
    actor of Ray Data's in the Ray it ran in (its autoscaling coordinator): removed here,
    as the later tests' leak checks (and their autoscaler) expect the Ray as it was."""
    twins = (_block("trainer = TorchTrainer("), _block('print("horovod_ray", result.metrics'))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(run_fresh_python, twin, SNIPPET_S, True) for twin in twins]
            trainer, twin = (run.result() for run in runs)
    finally:
        with contextlib.suppress(ValueError):  # none was started
            ray.kill(ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator"))
    assert "TorchTrainer 3 2" in trainer.splitlines()
    assert twin.splitlines()[-1] == "horovod_ray 3 2"


def test_jobs_snippet_lists_the_running_job(joined):
    out = run_fresh_python(_block('create_settings(name="listed")'), SNIPPET_S, join_ray=True)
    assert "listed running 2 None" in out.splitlines()


def test_quickstart_executor_snippet(joined):
    out = run_fresh_python(_block("RayExecutor(settings"), SNIPPET_S, join_ray=True)
    assert "RankInfo(world_rank=0" in out


def test_tune_snippet(joined):
    out = run_fresh_python(_block("DistributedTrainableCreator(train"), SNIPPET_S, join_ray=True)
    assert "{'lr': 0.01}" in out


def test_gpu_snippets_give_each_local_rank_its_own_gpu():
    # PyTorch's, then TensorFlow's, in one interpreter: the second's ray.init() finds the
    # first's local Ray with its two logical GPUs.
    torch, tensorflow = _block("torch.cuda.set_device"), _block("set_memory_growth")
    out = run_fresh_python(torch + "\n" + tensorflow, SNIPPET_S)
    *_, first, second = out.strip().splitlines()
    assert ast.literal_eval(first) == [("0,1", 0), ("0,1", 1)]
    assert ast.literal_eval(second) == [0, 1]


def test_hang_snippet_names_the_missing_rank_and_its_sleeping_line(joined):
    out = run_fresh_python(_block("stall_timeout_s=4"), SNIPPET_S, join_ray=True)
    assert out.startswith("(1,) (0,)\n"), out[-3000:]
    assert 'File "<dynamic-code>", line 11, in train' in out  # the time.sleep


def test_elastic_snippet(joined):
    out = run_fresh_python(_block("min_workers=2, max_workers=4"), SNIPPET_S, join_ray=True)
    # Membership dicts from the callback, then the final world's results (one per rank).
    assert "'event': 'membership'" in out
    results = ast.literal_eval(out.strip().splitlines()[-1])
    assert len(results) >= 2 and set(results) == {len(results)}


def test_tune_example_command_prints_the_best_config(joined):
    line = next(text for text in DOCS.splitlines() if "tune_tensorflow2_digits.py --num" in text)
    command = shlex.split(line.strip())
    command[0] = sys.executable
    # The full run is the docs'; fewer trials and epochs keep CI short. Two trials at
    # least: with one, the best config would be the minimum whatever the example picked.
    command[command.index("--num-samples") + 1] = "2"
    command += ["--epochs", "2"]
    out = run_fresh(command, COMMAND_S, join_ray=True)
    rows = re.findall(r"^ *\w+_0000\d +([\d.]+) +(\d) +([\d.]+) +([\d.]+)$", out, re.M)
    assert len(rows) == 2
    best = re.search(r"best config: lr=([\d.]+) +loss ([\d.]+) +accuracy ([\d.]+)", out)
    assert float(best.group(2)) == pytest.approx(min(float(row[2]) for row in rows), abs=1e-4)


@pytest.mark.parametrize("example", ["tensorflow2_digits.py", "pytorch_digits.py"])
def test_example_command_reaches_the_accuracy(example, joined):
    line = next(text for text in DOCS.splitlines() if f"examples/{example} --num" in text)
    command = shlex.split(line.strip())
    assert command[0] == ".venv/bin/python"
    command[0] = sys.executable
    out = run_fresh(command, COMMAND_S, join_ray=True)
    progress = re.findall(r"^epoch +(\d+)/(\d+) +loss ([\d.]+)", out, re.MULTILINE)
    assert [int(epoch) for epoch, _, _ in progress] == list(range(1, 16))
    assert float(progress[-1][2]) < float(progress[0][2])  # the loss went down
    accuracy = float(re.search(r"final held-out accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.9
    assert len(re.findall(r"^rank \d: trained on", out, re.MULTILINE)) == 2


def test_readme_renders_on_its_own_with_absolute_links_only():
    """README is the package's long description: plain reStructuredText (no Sphinx roles),
    and no link that only works inside this checkout."""
    import docutils.core
    import docutils.nodes

    document = docutils.core.publish_doctree(
        README, settings_overrides={"halt_level": 2, "report_level": 2}
    )
    for reference in document.findall(docutils.nodes.reference):
        assert re.match(r"https?://", reference.get("refuri", "")), reference
    assert len(README.splitlines()) < 100  # a front page; the rest is in docs/


def test_the_api_reference_documents_every_public_name():
    """A name added to ``__all__`` must reach the API page, as the flags do by the parser."""
    import horovod_ray
    import horovod_ray.tune

    api = (ROOT / "docs" / "api.rst").read_text()
    # py:data: a str's autodata would show str's own docstring.
    documented = set(re.findall(r"^\.\. (?:auto\w+|py:data):: ([\w.]+)$", api, re.M))
    members = re.search(r"RayExecutor\n   :members: (.*(?:\n      .*)*)", api)[1]
    documented |= {f"horovod_ray.RayExecutor.{name.strip()}" for name in members.split(",")}
    for module in (horovod_ray, horovod_ray.tune):
        for name in module.__all__:
            assert f"{module.__name__}.{name}" in documented, name
    public = [name for name in dir(horovod_ray.RayExecutor) if not name.startswith("_")]
    for name in public:
        assert f"horovod_ray.RayExecutor.{name}" in documented, name


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import check_links
    finally:
        sys.path.remove(str(ROOT / "docs"))
    (tmp_path / "a.html").write_text(
        '<p id="here"><a href="b.html#gone">x</a><a href="#here">y</a>'
        '<a href="c.html">z</a><a href="https://example.org/x">w</a></p>'
    )
    (tmp_path / "b.html").write_text('<p id="there"></p>')
    assert check_links.broken_links(tmp_path) == [
        "a.html: b.html#gone (no such anchor)",
        "a.html: c.html (no such file)",
    ]
    (tmp_path / "a.html").write_text('<a href="b.html#there">x</a>')
    assert check_links.broken_links(tmp_path) == []


def test_command_line_example_runs_unmodified_script(joined):
    # Joins the module's Ray (the CLI reads RAY_ADDRESS); the CLI starting and stopping a
    # local Ray of its own is test_cli's test_same_lines_as_horovodrun.
    line = next(text for text in DOCS.splitlines() if ".venv/bin/horovod-ray run -np 2" in text)
    command = shlex.split(line.strip())
    assert command[:2] == [".venv/bin/horovod-ray", "run"]
    venv_bin = Path(sys.executable).parent
    command[0] = str(venv_bin / "horovod-ray")
    command[command.index(".venv/bin/python")] = sys.executable
    out = run_fresh(command, COMMAND_S, join_ray=True)
    epochs = re.findall(r"^\[0\]<stdout>:epoch +(\d+) +loss ([\d.]+)", out, re.M)
    assert [int(epoch) for epoch, _ in epochs] == [1, 2, 3]
    accuracies = re.findall(
        r"^\[(\d)\]<stdout>:rank \d of 2: held-out accuracy ([\d.]+)", out, re.M
    )
    assert sorted(rank for rank, _ in accuracies) == ["0", "1"]
    assert all(float(accuracy) > 0.8 for _, accuracy in accuracies)


@pytest.mark.parametrize("example", ["elastic_tensorflow2_digits.py", "elastic_pytorch_digits.py"])
def test_elastic_example_command_trains(example, joined):
    line = next(text for text in DOCS.splitlines() if f"examples/{example} --" in text)
    command = shlex.split(line.strip())
    assert command[0] == ".venv/bin/python"
    command[0] = sys.executable
    # The docs' command as written, at its smallest world: on 2 cores the two more ranks
    # only add their imports, and a world that grows is test_elastic_snippet's.
    command[command.index("--max-workers") + 1] = "2"
    out = run_fresh(command, COMMAND_S, join_ray=True)
    assert re.search(r"^membership: 0 -> \d ranks", out, re.M), out
    final = re.search(r"final world: (\d) ranks, held-out accuracy ([\d.]+)", out)
    assert int(final.group(1)) >= 2 and float(final.group(2)) > 0.7


def test_every_shell_block_is_run_by_a_test_or_by_make():
    """A new shell block must get a test: each known one is run above, in test/hosts (the
    Ray Jobs command), by make itself, or mirrors the Makefile (below)."""
    known = (
        "make demo",
        "make bench",
        ".venv/bin/horovod-ray run -np 2 ",
        "ray job submit ",
        ".venv/bin/python examples/",
        "rm -rf build/horovod\n",
        "make install  ",
        "ray drain-node ",  # by test/job/test_multinode.py, on its cluster
        "make wheels\n",  # and the rest by test/deploy (make test-deploy)
        "make image\n",  # by test/deploy/test_image.py (make test-image), but the push
        # Not run here (no Kubernetes, no cloud): test/deploy/test_manifests.py checks the
        # manifests they apply and runs their jobs' commands on a local Ray cluster.
        "kubectl apply -f deploy/kuberay/rayjob.yaml\n",
        "ray up deploy/cluster-launcher/aws.yaml\n",
    )
    for block in doc_blocks("bash"):
        assert block.startswith(known), block


def test_the_testing_pages_commands_are_the_makefiles():
    """docs/testing.rst's way to run one part: the Makefile's own passes and targets."""
    (block,) = [b for b in doc_blocks("bash") if b.startswith("make install  ")]
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PY) -m pytest $(PYTEST_ARGS) -m unit test\n" in makefile
    assert ".venv/bin/python -m pytest -m unit test " in block
    for target in re.findall(r"^make ([\w-]+)", block, re.M):
        assert re.search(rf"^{target}:", makefile, re.M), target


def test_the_hand_build_of_horovod_is_the_makefiles():
    (block,) = [b for b in doc_blocks("bash") if b.startswith("rm -rf build/horovod")]
    makefile = (ROOT / "Makefile").read_text()
    flags = re.search(r"^HOROVOD_FLAGS := ((?:.*\\\n)*.*)$", makefile, re.M).group(1)
    # The default line's: with PyTorch.
    torch = re.search(r"^HOROVOD_TORCH := (.*)$", makefile, re.M).group(1)
    flags = flags.replace("\\\n", " ").replace("$(HOROVOD_TORCH)", torch)
    for flag in [*flags.split(), "MAKEFLAGS=-j$(nproc)"]:
        assert flag in block, flag
    assert re.search(r"^HOROVOD_VERSION := 0\.28\.1$", makefile, re.M)
    assert "pip install --no-build-isolation --no-cache-dir --force-reinstall --no-deps" in block
    assert "patches/horovod-0.28.1-*.patch" in block


def test_readmes_support_matrix_is_the_install_pages():
    def matrix(text: str) -> str:
        return re.search(
            r"^=+  =+.*\nline .*\n(?:.*\n)*?=+  =+.*\n(?:.*\n)*?=+  =+.*\n", text, re.M
        )[0]

    assert matrix(README) == matrix((ROOT / "docs" / "install.rst").read_text())


def _ray_not_initialised() -> str:
    # In a fresh interpreter: this one may hold a Ray of an earlier test.
    code = (
        "from horovod_ray import RayExecutor\n"
        "try:\n"
        "    RayExecutor(num_workers=1).start()\n"
        "except Exception as error:\n"
        "    print(f'{type(error).__name__}: {error}')\n"
    )
    return run_fresh_python(code).strip()


def _nics_no_node_has() -> str:
    from horovod_ray import ConfigError
    from horovod_ray.rank.network import NodeFacts, gloo_ifaces

    node = NodeFacts(
        node_id="a" * 40,
        node_ip="10.0.0.2",
        node_ip_iface="ens5",
        loopback_iface="lo",
        interfaces=("ens5", "lo"),
        hostname="worker-2",
        hostname_address=None,
        gloo_iface_fixed=True,
    )
    with pytest.raises(ConfigError) as info:
        gloo_ifaces([node], ["eth9"], local_job=False)
    return f"ConfigError: {info.value}"


# torch.nn.SyncBatchNorm on CPU tensors in training, in a fresh interpreter: without a
# torch.distributed process group (as under horovod), then with one (of one process).
_SYNC_BATCH_NORM = """
import json, os, torch, torch.distributed as dist
torch.manual_seed(0)
x, sync, plain = torch.randn(8, 3), torch.nn.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
same = bool(torch.equal(sync(x), plain(x)))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", rank=0, world_size=1)
try:
    sync(x)
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
dist.destroy_process_group()
print(json.dumps({"plain_without_a_group": same, "error_with_a_group": error}))
"""


@functools.cache
def _sync_batch_norm_on_cpu() -> dict:
    return json.loads(run_fresh_python(_SYNC_BATCH_NORM).strip().splitlines()[-1])


def _sync_batch_norm_with_a_process_group() -> str:
    return _sync_batch_norm_on_cpu()["error_with_a_group"] or "no error"


def test_torch_sync_batch_norm_without_torch_distributed_is_a_plain_batch_norm():
    """docs/pytorch.rst: under horovod, which sets up no torch.distributed process group,
    ``torch.nn.SyncBatchNorm`` takes CPU tensors and syncs nothing (the page said it
    refused them; only with a process group does it, see QUOTED_ERRORS)."""
    assert _sync_batch_norm_on_cpu()["plain_without_a_group"] is True
    page = " ".join((ROOT / "docs" / "pytorch.rst").read_text().split())
    assert "under horovod it is a plain batch norm over each rank's own batch" in page


# How to make each error whose text the documentation quotes, by its first words.
QUOTED_ERRORS = {
    "HorovodRayError: Ray is not initialised": _ray_not_initialised,
    "ConfigError: nics=": _nics_no_node_has,
    "ValueError: SyncBatchNorm expected": _sync_batch_norm_with_a_process_group,
}


def test_the_error_texts_the_docs_quote_are_the_real_ones():
    """Each ``SomeError: text`` the docs quote is what the library raises; "..." stands
    for text left out (a value, or the rest of the message)."""
    quoted = [
        (path.name, text)
        for path in DOC_FILES
        for text in re.findall(r"``(\w+Error: [^`]+)``", path.read_text())
    ]
    assert quoted, "the docs quote no error text"
    for page, text in quoted:
        maker = next((m for first, m in QUOTED_ERRORS.items() if text.startswith(first)), None)
        assert maker is not None, f"{page} quotes {text!r}: add how to make it to QUOTED_ERRORS"
        real, position = maker(), 0
        for part in (p.strip() for p in re.split(r"\.\.\.", text) if p.strip()):
            found = real.find(part, position)
            assert found >= 0, f"{page} quotes {text!r}; the real text is {real!r}"
            position = found + len(part)


def test_the_command_lines_flags_the_docs_name_are_the_parsers():
    """Each ``horovod-ray run ...`` the pages quote takes only flags the command line has
    (docs/gpus.rst named ``--nics``, which neither it nor horovodrun has)."""
    from horovod_ray.cli.parser import build_parser

    run = next(
        action.choices["run"]
        for action in build_parser()._actions  # noqa: SLF001 - the subcommand's parser
        if isinstance(action, argparse._SubParsersAction)  # noqa: SLF001
    )
    known = set(run._option_string_actions)  # noqa: SLF001 - every spelling of every flag
    quoted = [
        (path.name, literal)
        for path in DOC_FILES
        for literal in re.findall(r"``((?:\.venv/bin/)?horovod-ray run[^`]*)``", path.read_text())
    ]
    assert len(quoted) >= 8, quoted
    for page, literal in quoted:
        words = shlex.split(literal)[2:]
        for word in itertools.takewhile(lambda w: "python" not in w, words):
            if word.startswith("-"):
                assert word.split("=")[0] in known, f"{page}: {literal!r} names {word}"


def test_the_install_pages_extras_are_setups():
    """docs/install.rst lists every extra of setup.py (it left out ``tensorflow-gpu``),
    with the PyTorch versions setup.py takes (it said 2.13 where setup.py takes 2.14)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    )
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    install = (ROOT / "docs" / "install.rst").read_text()
    listed = re.search(r"any of the extras setup.py has:\n\n((?:[*] .*\n(?:  .*\n)*)+)", install)
    bullets = {
        name: text
        for name, text in re.findall(r"^[*] ``([\w-]+)``: (.*(?:\n  .*)*)", listed[1], re.M)
    }
    assert set(bullets) == set(extras)
    (torch,) = extras["torch"]
    assert f"``{torch}``" in bullets["torch"]


def test_the_install_pages_ray_default_brings_what_it_says():
    """``ray[default]`` brings py-spy, not psutil, which horovod requires."""
    import importlib.metadata

    install = " ".join((ROOT / "docs" / "install.rst").read_text().split())
    said = re.search(r"``default`` brings (.*?);", install)[1]
    default = {
        re.split(r"[<>=!;\[ ]", requirement)[0].lower()
        for requirement in importlib.metadata.requires("ray")
        if 'extra == "default"' in requirement
    }
    horovod = {
        re.split(r"[<>=!;\[ ]", r)[0].lower() for r in importlib.metadata.requires("horovod")
    }
    for package in ("py-spy", "psutil"):
        assert (package in said) == (package in default), (package, said)
    assert (
        "psutil" in horovod
        and "psutil (the command line's process trees) comes with horovod" in install
    )


def test_the_testing_page_gives_make_tests_steps_in_the_makefiles_order():
    """docs/testing.rst said both environments were built before the documentation; make
    test's prerequisites, in order, are the docs, the suite, then the 2023 line's."""
    makefile = (ROOT / "Makefile").read_text()
    steps = re.search(r"^else ifeq \(\$\(TF\),2\.21\)\ntest: (.*)$", makefile, re.M)[1]
    testing = " ".join((ROOT / "docs" / "testing.rst").read_text().split())
    assert f"Makefile's order, ``test: {steps}``" in testing
    order = ["the documentation", "the first two passes", "2023 line's environment"]
    positions = [testing.index(part) for part in order]
    assert positions == sorted(positions)
    assert "builds both environments" not in testing
