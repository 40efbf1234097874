"""Recipes as data: a ConfigDict builds its dataclass with every key and type checked, a partial group keeps the
rest of its default group, and a dataclass goes back to its ConfigDict unchanged."""

import dataclasses

import ml_collections
import pytest

from configs import schema


@dataclasses.dataclass(frozen=True)
class Source:
    name: str = "mnist"
    split: str = "train"


@dataclasses.dataclass(frozen=True)
class Stage:
    steps: int
    lr: float = 1e-3


@dataclasses.dataclass(frozen=True)
class Run(schema.Schema):
    KIND = "run"

    source: Source = Source(name="fashion", split="test")
    stages: tuple[Stage, ...] = ()
    extra: Stage | None = None
    sizes: dict[str, float] = dataclasses.field(default_factory=dict)
    shape: tuple[int, int] = (1, 1)


def test_a_partial_group_keeps_its_default_group():
    run = Run.from_config(ml_collections.ConfigDict({"kind": "run", "source": {"split": "train"}}))
    assert run.source == Source(name="fashion", split="train")  # not Source()'s "mnist"
    run = Run.from_config({"stages": [{"steps": 3}, {"steps": 4, "lr": 1}], "extra": {"steps": 2},
                           "sizes": {"v4": 32}, "shape": [2, 3]})
    assert run.stages == (Stage(3), Stage(4, 1.0)) and isinstance(run.stages[1].lr, float)
    assert run.extra == Stage(2) and run.sizes == {"v4": 32.0} and run.shape == (2, 3)
    assert Run.from_config({"extra": None}).extra is None


@pytest.mark.parametrize("config, needle", [
    ({"kind": "walk"}, "kind: 'walk' is not 'run'"),
    ({"sourse": {}}, "unknown config key 'sourse' (no field 'sourse' in Run)"),
    ({"source": {"nmae": "x"}}, "unknown config key 'source.nmae' (no field 'nmae' in Source)"),
    ({"source": "mnist"}, "source: expected a group of settings (Source)"),
    ({"source": {"name": 3}}, "source.name: expected str, got 3"),
    ({"stages": [{"lr": 1.0}]}, "missing config key 'stages.steps'"),
    ({"extra": {"steps": 1.5}}, "extra: {'steps': 1.5} is not a"),
    ({"shape": (1, 2, 3)}, "shape: expected 2 values, got 3"),
    ({"sizes": {"v4": "big"}}, "sizes.v4: expected float"),
])
def test_wrong_keys_and_types_are_one_line_naming_the_key(config, needle):
    with pytest.raises(ValueError) as e:
        Run.from_config(config)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_field_types_through_groups():
    assert schema.field_type(Run, "source.name") is str
    assert schema.group_type(schema.field_type(Run, "extra")) is Stage
    with pytest.raises(ValueError, match="unknown config key 'source.name.x'"):
        schema.field_type(Run, "source.name.x")


def test_every_preset_goes_back_to_its_config_unchanged():
    """`to_config` of a validated preset builds the same dataclass: the schema covers every field."""
    from configs import cli
    from configs.sage import smollm2_eagle
    from pgla_jax.config import DenoiserConfig, ExperimentConfig
    from sage_jax.io.paper_targets import PaperTargets
    from sage_jax.training.recipe import DraftRecipe
    from sage_jax.training.vlm_recipe import VLMRecipe

    specs = {"configs.sage": ["tiny", "smollm2_vlm", "paper_targets"]
             + [f"smollm2_eagle:{s}" for s in smollm2_eagle.STAGES],
             "configs.pgla": ["mnist_lenet", "stl10_lenet", "digits_tiny", "denoiser_tiny", "denoiser_patches"]}
    kinds = (DraftRecipe, VLMRecipe, PaperTargets, ExperimentConfig, DenoiserConfig)
    for package, names in specs.items():
        for name in names:
            cfg = cli.load_config(name, package, kinds)
            cd = schema.to_config(cfg)
            assert cd.kind == type(cfg).KIND and type(cfg).from_config(cd) == cfg, name
