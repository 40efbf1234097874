"""The CLI contract: one-line errors with exit code 2, configs from names or files, `--set` on frozen dataclasses."""

import dataclasses
from typing import Literal

import pytest

from configs import cli


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    steps: int = 10
    lr: float = 1e-3
    name: str = "a"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    inner: Inner = Inner()
    kinds: tuple[Literal["x", "y"], ...] = ("x",)
    seeds: tuple[int, ...] = ()
    mode: Literal["fast", "slow"] = "fast"
    limit: int | None = None
    flag: bool = False

    def __post_init__(self):
        if self.inner.steps < 0:
            raise ValueError("steps must be >= 0")


def test_override_parses_values_by_field_type():
    c = Outer()
    assert cli.override(c, "inner.steps=3").inner.steps == 3
    assert cli.override(c, "inner.lr=1").inner.lr == 1.0 and isinstance(cli.override(c, "inner.lr=1").inner.lr, float)
    assert cli.override(c, "inner.name=b").inner.name == "b"  # a bare word is a string
    assert cli.override(c, "kinds=x,y").kinds == ("x", "y")
    assert cli.override(c, "seeds=(1, 2)").seeds == (1, 2)
    assert cli.override(c, "mode=slow").mode == "slow"
    assert cli.override(c, "limit=None").limit is None and cli.override(c, "limit=4").limit == 4
    assert cli.override(c, "flag=True").flag is True
    assert cli.override(c, "flag=true").flag is True and cli.override(c, "flag=FALSE").flag is False
    assert c == Outer()  # frozen: a new config every time


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
    ("inner.steps=-1", "steps must be >= 0"),  # the config's own check
    ("steps", "KEY=VALUE"),
])
def test_override_rejects_with_one_line(assignment, needle):
    with pytest.raises(cli.BadInput, match=needle) as e:
        cli.override(Outer(), assignment)
    assert "\n" not in str(e.value)


def test_load_config_names_files_and_mistakes(tmp_path):
    from pgla_jax.config import DenoiserConfig, ExperimentConfig

    assert isinstance(cli.load_config("mnist_lenet", "configs.pgla", ExperimentConfig), ExperimentConfig)
    good = tmp_path / "good.py"
    good.write_text("from configs.pgla import denoiser_tiny\n\n\ndef get_config():\n"
                    "    return denoiser_tiny.get_config()\n")
    assert isinstance(cli.load_config(str(good), "configs.pgla", DenoiserConfig), DenoiserConfig)
    cases = {"syntax.py": ("def get_config(:\n", "cannot load config"), "none.py": ("x = 1\n", "no get_config"),
             "raises.py": ("def get_config():\n    raise KeyError('k')\n", r"get_config\(\) failed"),
             "int.py": ("def get_config():\n    return 3\n", "returns int, expected DenoiserConfig")}
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(cli.BadInput, match=needle):
            cli.load_config(str(tmp_path / name), "configs.pgla", DenoiserConfig)
    for spec, needle in (("no_such", "unknown config"), ("../x", "unknown config"), ("/no/file.py", "not found")):
        with pytest.raises(cli.BadInput, match=needle):
            cli.load_config(spec, "configs.pgla", DenoiserConfig)


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


def test_every_pgla_preset_loads_as_its_kind():
    # A preset that no test imports must still build: every file in configs/pgla returns an ExperimentConfig or a
    # DenoiserConfig, and denoiser presets fit their victim's gradient (the U-Net's downsampling divides the side).
    import pkgutil

    import configs.pgla
    from pgla_jax.config import DenoiserConfig, ExperimentConfig

    names = [m.name for m in pkgutil.iter_modules(configs.pgla.__path__)]
    assert {"mnist_lenet", "patches_lenet", "cifar100_lenet", "denoiser_lenet", "denoiser_paper"} <= set(names)
    for name in names:
        cfg = cli.load_config(name, "configs.pgla", (ExperimentConfig, DenoiserConfig))
        if isinstance(cfg, DenoiserConfig):
            assert cfg.batch_size >= 1 and cfg.unet.width % cfg.unet.groups == 0, name
        else:
            assert len(cfg.victim.image_shape) == 3 and cfg.num_images % cfg.batch_size == 0, name


def test_every_sage_draft_recipe_loads():
    # Like the PGLA presets: every draft recipe in configs/sage builds (the continued ones name the data and the head
    # they start from).
    import pkgutil

    import configs.sage
    from sage_jax.training.recipe import DraftRecipe

    names = [m.name for m in pkgutil.iter_modules(configs.sage.__path__)]
    recipes = [n for n in names if n.startswith(("smollm2_eagle", "tiny"))]
    want = {"smollm2_eagle_chat2", "smollm2_eagle_chat4", "smollm2_eagle_chat6", "smollm2_eagle_device", "tiny"}
    assert want <= set(recipes)
    for name in recipes:
        cfg = cli.load_config(name, "configs.sage", DraftRecipe)
        assert cfg.kinds, name
    chat6 = cli.load_config("smollm2_eagle_chat6", "configs.sage", DraftRecipe)
    assert chat6.data.answers == "runs/self_prompts/answers.jsonl" and not chat6.data.rollouts
    assert chat6.eagle.init_from == "runs/smollm2_eagle_chat4/eagle_head"
    device = cli.load_config("smollm2_eagle_device", "configs.sage", DraftRecipe)  # the shipped head's recipe
    assert device.eagle.init_from == chat6.eagle.init_from and not device.data.rollouts and device.data.answers
    assert (device.vocab_size, device.eagle.taps, device.eagle.train.batch_size) == (8192, (), 64)
