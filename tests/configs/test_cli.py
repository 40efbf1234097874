"""The CLI contract: one-line errors with exit code 2, recipes (plain-data ConfigDicts) from names or files, `--set`
typed by the consuming dataclass, and every preset of configs/ validated by its package."""

import dataclasses
import os
from typing import Literal

import ml_collections
import pytest

from configs import cli
from configs.schema import Schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    steps: int = 10
    lr: float = 1e-3
    name: str = "a"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer(Schema):
    KIND = "outer"

    inner: Inner = Inner()
    kinds: tuple[Literal["x", "y"], ...] = ("x",)
    seeds: tuple[int, ...] = ()
    mode: Literal["fast", "slow"] = "fast"
    limit: int | None = None
    flag: bool = False

    def __post_init__(self):
        if self.inner.steps < 0:
            raise ValueError("steps must be >= 0")


@pytest.fixture
def outer_file(tmp_path):
    """A recipe file of `Outer` that gives one field: the rest are the dataclass's defaults."""
    path = tmp_path / "outer.py"
    path.write_text("import ml_collections\n\n\ndef get_config(arg=None):\n"
                    "    return ml_collections.ConfigDict({'kind': 'outer', 'inner': {'name': arg or 'a'}})\n")
    return str(path)


def test_override_parses_values_by_field_type(outer_file):
    def load(*sets):
        return cli.load_config(outer_file, "configs", Outer, overrides=sets)

    assert load("inner.steps=3").inner == Inner(steps=3)
    assert load("inner.lr=1").inner.lr == 1.0 and isinstance(load("inner.lr=1").inner.lr, float)
    assert load("inner.name=b").inner.name == "b"  # a bare word is a string
    assert load("kinds=x,y").kinds == ("x", "y")
    assert load("seeds=(1, 2)").seeds == (1, 2)
    assert load("mode=slow").mode == "slow"
    assert load("limit=None").limit is None and load("limit=4").limit == 4
    assert load("flag=True").flag is True
    assert load("flag=true").flag is True and load("flag=true", "flag=FALSE").flag is False
    assert load("inner.steps=3", "inner.lr=0.5").inner == Inner(steps=3, lr=0.5)
    cd = ml_collections.ConfigDict({"kind": "outer"})
    assert cli.override(cd, "inner.steps=3", Outer).inner.steps == 3 and "inner" not in cd  # a copy, group added
    assert cli.load_config(outer_file.replace(".py", ".py:b"), "configs", Outer).inner.name == "b"  # FILE.py:ARG


@pytest.mark.parametrize("assignment, needle", [
    ("inner.nope=1", "unknown config key"),
    ("nope.steps=1", "unknown config key"),
    ("inner.steps=abc", "expected int"),
    ("inner.steps=1.5", "expected int"),
    ("flag=1", "expected bool"),
    ("flag=yes", "expected bool"),
    ("kinds=z", "not one of"),
    ("mode=medium", "not one of"),
    ("inner=3", "group of settings"),
    ("inner.steps=-1", "--set inner.steps: steps must be >= 0"),  # the dataclass's own check
    ("steps", "KEY=VALUE"),
])
def test_override_rejects_with_one_line(outer_file, assignment, needle):
    with pytest.raises(cli.BadInput, match=needle) as e:
        cli.load_config(outer_file, "configs", Outer, overrides=[assignment])
    assert "\n" not in str(e.value)


def test_load_config_names_files_and_mistakes(tmp_path):
    from pgla_jax.config import DenoiserConfig, ExperimentConfig

    assert isinstance(cli.load_config("mnist_lenet", "configs.pgla", ExperimentConfig), ExperimentConfig)
    good = tmp_path / "good.py"
    good.write_text("from configs.pgla import denoiser_tiny\n\n\ndef get_config():\n"
                    "    c = denoiser_tiny.get_config()\n    c.steps = 7\n    return c\n")
    assert cli.load_config(str(good), "configs.pgla", DenoiserConfig).steps == 7
    cases = {"syntax.py": ("def get_config(:\n", "cannot load config"), "none.py": ("x = 1\n", "no get_config"),
             "raises.py": ("def get_config():\n    raise KeyError('k')\n", r"get_config\(\) failed"),
             "int.py": ("def get_config():\n    return 3\n", "returns int, expected DenoiserConfig"),
             "nokind.py": ("def get_config():\n    return {'steps': 3}\n", "without a kind, expected DenoiserConfig"),
             "other.py": ("from configs.pgla import mnist_lenet\nget_config = mnist_lenet.get_config\n",
                          "returns a 'experiment' config, expected DenoiserConfig"),
             "key.py": ("def get_config():\n    return {'kind': 'denoiser', 'stpes': 3}\n",
                        "unknown config key 'stpes'"),
             "type.py": ("def get_config():\n    return {'kind': 'denoiser', 'unet': {'mults': 2}}\n",
                         "unet.mults: expected a tuple"),
             "arg.py": ("def get_config():\n    return {'kind': 'denoiser'}\n", r"get_config\(\) failed: TypeError")}
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        spec = str(tmp_path / name) + (":x" if name == "arg.py" else "")
        with pytest.raises(cli.BadInput, match=needle) as e:
            cli.load_config(spec, "configs.pgla", DenoiserConfig)
        assert "\n" not in str(e.value)
    for spec, needle in (("no_such", "unknown config"), ("../x", "unknown config"), ("/no/file.py", "not found"),
                         ("no_such:arg", "unknown config")):
        with pytest.raises(cli.BadInput, match=needle):
            cli.load_config(spec, "configs.pgla", DenoiserConfig)


def test_config_names_of_workdirs():
    assert cli.split_spec("smollm2_eagle:answers6k") == ("smollm2_eagle", "answers6k")
    assert cli.split_spec("dir/x.py:a:b") == ("dir/x.py", "a:b") and cli.split_spec("tiny") == ("tiny", None)
    assert cli.config_name("smollm2_eagle:answers6k") == "smollm2_eagle_answers6k"
    assert cli.config_name("configs/sage/tiny.py") == "tiny"


def test_run_turns_bad_input_into_one_line_and_exit_2(capsys):
    def body(argv):
        p = cli.Parser(prog="x")
        p.add_argument("--n", type=int)
        args = p.parse_args(argv)
        with cli.reported(FileNotFoundError):
            if args.n == 1:
                raise FileNotFoundError("no such file: a\nsecond line")
        if args.n == 2:
            raise RuntimeError("a bug is not bad input")
        return 0

    assert cli.run(body, ["--n", "0"]) == 0
    assert cli.run(body, ["--n", "x"]) == 2
    assert capsys.readouterr().err == "error: argument --n: invalid int value: 'x'\n"
    assert cli.run(body, ["--n", "1"]) == 2 and capsys.readouterr().err == "error: no such file: a\n"
    with pytest.raises(RuntimeError):
        cli.run(body, ["--n", "2"])


def test_run_turns_ctrl_c_into_one_line_and_exit_130(capsys):
    def body(argv):
        raise KeyboardInterrupt

    assert cli.run(body, []) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert cli.run(body, [], resumable=True) == 130
    assert capsys.readouterr().err.strip() == "interrupted; rerun the same command to resume"


def test_a_ctrl_c_python_would_swallow_still_ends_the_command(capsys):
    """A KeyboardInterrupt raised inside a callback Python runs for itself (here a finaliser; in `generate`, XLA's
    garbage-collection callback) is only noted as "Exception ignored"; `run` delivers it again, so the command stops
    with exit 130 instead of running on to exit 0."""
    import signal
    import time

    class Dropped:
        def __del__(self):
            raise KeyboardInterrupt

    def body(argv):
        Dropped()  # its finaliser's KeyboardInterrupt is unraisable: Python drops it
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return 0

    # A command's Ctrl-C is Python's default handler (a test runner's worker may ignore SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.run(body, []) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err.strip().endswith("interrupted")


def test_every_pgla_preset_loads_as_its_kind():
    # Every file in configs/pgla is data (a ConfigDict with a kind) that builds an ExperimentConfig or a
    # DenoiserConfig; denoiser presets fit their victim's gradient (the U-Net's downsampling divides the side).
    import pkgutil

    import configs.pgla
    from pgla_jax.config import DenoiserConfig, ExperimentConfig

    names = {m.name for m in pkgutil.iter_modules(configs.pgla.__path__)}
    assert names == {"mnist_lenet", "cifar100_lenet", "stl10_lenet", "patches_lenet", "digits_tiny", "denoiser_lenet",
                     "denoiser_paper", "denoiser_patches", "denoiser_tiny"}
    for name in sorted(names):
        cfg = cli.load_config(name, "configs.pgla", (ExperimentConfig, DenoiserConfig))
        if isinstance(cfg, DenoiserConfig):
            assert cfg.batch_size >= 1 and cfg.unet.width % cfg.unet.groups == 0, name
        else:
            assert len(cfg.victim.image_shape) == 3 and cfg.num_images % cfg.batch_size == 0, name
    # The paper's colour victims and the shipped prior's victim share the 32×32×3 LeNet and its 4,000 iterations.
    cifar, patches = (cli.load_config(n, "configs.pgla", ExperimentConfig) for n in ("cifar100_lenet", "patches_lenet"))
    assert (cifar.victim.num_classes, patches.victim.num_classes, patches.attack.iterations) == (100, 10, 4000)
    assert patches.victim.image_shape == cli.load_config("denoiser_patches", "configs.pgla",
                                                         DenoiserConfig).gradients.victim.image_shape


def test_every_sage_recipe_loads_as_its_kind():
    # Every file in configs/sage is data that its package validates; the shipped head's stages name the data and the
    # head each one continues, ending in the recipe of the device runs.
    import pkgutil

    import configs.sage
    from configs.sage import smollm2_eagle
    from sage_jax.io.paper_targets import PaperTargets
    from sage_jax.training.recipe import DraftRecipe
    from sage_jax.training.vlm_recipe import DraftVLMRecipe, VLMRecipe

    names = {m.name for m in pkgutil.iter_modules(configs.sage.__path__)}
    assert names == {"tiny", "smollm2_eagle", "smollm2_vlm", "smollm2_vlm_draft", "paper_targets"}
    kinds = {n: cli.load_config(n, "configs.sage", (DraftRecipe, VLMRecipe, DraftVLMRecipe, PaperTargets))
             for n in sorted(names)}
    assert [type(kinds[n]) for n in ("tiny", "smollm2_eagle", "smollm2_vlm", "smollm2_vlm_draft",
                                     "paper_targets")] == [DraftRecipe, DraftRecipe, VLMRecipe, DraftVLMRecipe,
                                                           PaperTargets]
    stages = {s: cli.load_config(f"smollm2_eagle:{s}", "configs.sage", DraftRecipe) for s in smollm2_eagle.STAGES}
    assert stages["device"] == kinds["smollm2_eagle"]  # the default: the shipped head's last stage
    scratch = stages["scratch"]
    assert scratch.data.rollouts and not scratch.eagle.init_from and scratch.data.extra_general_seeds == (1,)
    for prev, stage in zip(smollm2_eagle.STAGES, smollm2_eagle.STAGES[1:]):
        c = stages[stage]
        assert c.eagle.init_from == f"runs/smollm2_eagle_{prev}/eagle_head" and not c.data.rollouts, stage
        assert (c.vocab_size, c.eagle.taps, c.kinds) == (8192, (), ("eagle",)), stage
    assert (stages["answers4k"].data.answers, stages["answers4k"].data.n_answers) == ("runs/datastore/answers.jsonl",
                                                                                      4096)
    assert stages["answers6k"].data.n_answers == 6144
    device = stages["device"]
    assert device.data.answers == "runs/device/answers.jsonl" and device.data.n_general == 0
    assert (device.eagle.train.batch_size, device.eagle.train.steps) == (64, 6000)
    with pytest.raises(cli.BadInput, match="unknown stage 'chat4'"):
        cli.load_config("smollm2_eagle:chat4", "configs.sage", DraftRecipe)


def test_a_work_folder_knows_its_settings(tmp_path, capsys):
    work = tmp_path / "w"
    cli.settled(str(work), {"recipe": {"data": {"n_train": 48}, "train": {"steps": 10}}, "kinds": ("eagle",)})
    (work / "rows.npy").write_text("work")
    # The same settings (a tuple stored as a list), or another value of a free key: resumed.
    cli.settled(str(work), {"recipe": {"data": {"n_train": 48}, "train": {"steps": 20}}, "kinds": ["eagle"]},
                free=["recipe.train.steps"])
    with pytest.raises(cli.BadInput, match=r"recipe.data.n_train=48, this run asks 96: pass --restart"):
        cli.settled(str(work), {"recipe": {"data": {"n_train": 96}, "train": {"steps": 20}}, "kinds": ["eagle"]})
    assert (work / "rows.npy").read_text() == "work"  # refused: nothing touched
    cli.settled(str(work), {"recipe": {"data": {"n_train": 96}}}, restart=True)
    assert sorted(p.name for p in work.iterdir()) == [cli.SETTINGS_FILE]  # started over
    cli.settled(str(work), {"recipe": {"data": {"n_train": 7}}})  # no work yet (a run that failed at once): free
    old = tmp_path / "old"  # made before work folders recorded settings: resumed, and checked from now on
    old.mkdir()
    (old / "ckpt").write_text("x")
    cli.settled(str(old), {"a": 1})
    assert (old / "ckpt").exists() and capsys.readouterr().err == ""
    with pytest.raises(cli.BadInput, match="a=1, this run asks 2"):
        cli.settled(str(old), {"a": 2})


def test_written_never_leaves_a_torn_file(tmp_path):
    out = tmp_path / "results.json"
    out.write_text('{"old": true}')
    with pytest.raises(RuntimeError), cli.written(str(out)) as f:
        f.write('{"new": tr')
        raise RuntimeError("interrupted mid-write")
    assert out.read_text() == '{"old": true}' and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    with cli.written(str(out)) as f:
        f.write('{"new": true}')
    assert out.read_text() == '{"new": true}' and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    # Two writers of one output at once (two processes, or blocks inside each other) never share a partial file:
    # the last to finish puts its own whole.
    with cli.written(str(out)) as a, cli.written(str(out)) as b:
        assert a.name != b.name
        a.write("A")
        b.write("B")
    assert out.read_text() == "A"
    # `unless`: an output already there (a concurrent writer's, which won the race) is kept, the new one dropped.
    with cli.replacing(str(out), unless=os.path.isfile) as staged, open(staged, "w") as f:
        f.write("lost")
    assert out.read_text() == "A" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_forced_rerun_replaces_the_earlier_results_and_nothing_else(tmp_path):
    """`output_dir` / `begin_outputs` / `end_outputs`: a results folder remembers what its last run wrote; without
    --force any of it refuses the run, with it those files go before the new ones are written (an old plot never
    sits beside a new table), and a file the user put there stays."""
    out = str(tmp_path / "out")
    cli.output_dir(out, "--out", False, ("table.md",))
    cli.begin_outputs(out, ("table.md",))
    for name in ("table.md", "old_plot.png"):
        (tmp_path / "out" / name).write_text("earlier run")
    cli.end_outputs(out, [str(tmp_path / "out" / "table.md"), "old_plot.png"])
    (tmp_path / "out" / "notes.txt").write_text("mine")
    (tmp_path / "out" / "table.md").unlink()  # only a listed plot left: still the earlier run's
    with pytest.raises(cli.BadInput, match="old_plot.png exists; pass --force"):
        cli.output_dir(out, "--out", False, ("table.md",))
    cli.output_dir(out, "--out", True, ("table.md",))
    cli.begin_outputs(out, ("table.md",))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["notes.txt"]
    (tmp_path / "out" / cli.OUTPUTS_FILE).write_text("../outside\n/etc/passwd\nnotes.txt\n")  # never outside
    (tmp_path / "outside").write_text("kept")
    cli.begin_outputs(out)
    assert (tmp_path / "outside").read_text() == "kept" and not (tmp_path / "out" / "notes.txt").exists()
