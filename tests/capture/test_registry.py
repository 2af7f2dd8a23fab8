"""The family registry (capture/registry.py): the order families and block kinds are tried in, the dispatch
and facts it drives, the texts generated from it, and README's family table, which must list exactly the
registry's rows."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import attnroll
from attnroll.capture import anatomy, hooks, registry
from attnroll.capture import _select_adapter, model_facts

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| family | streams | prefix (suffix) tokens | readout (the rows the prediction reads) |"


def readme_rows(text: str) -> list[str]:
    """The rows of README's family table (header and rule excluded), each as one line."""
    lines = text.splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def disagreements(readme: list[str], rows: list[str]) -> list[str]:
    """Rows only README has and rows only the registry has (the refusals compared item by item)."""
    def split(rs: list[str]) -> tuple[set[str], set[str]]:
        refused = [r for r in rs if r.startswith("| refused, with the reason |")]
        items = set()
        for r in refused:
            items |= {i.strip() for i in re.split(r",\s+(?![^()]*\))", r.split("|")[2])}
        return {r for r in rs if r not in refused}, items

    (rm, ri), (gm, gi) = split(readme), split(rows)
    return ([f"README only: {r}" for r in sorted(rm - gm)] + [f"registry only: {r}" for r in sorted(gm - rm)]
            + [f"refused, README only: {i}" for i in sorted(ri - gi)]
            + [f"refused, registry only: {i}" for i in sorted(gi - ri)])


def test_the_readme_family_table_is_the_registry_s():
    readme = readme_rows(README.read_text(encoding="utf-8"))
    assert len(readme) == len(set(readme))
    assert disagreements(readme, registry.table_rows()) == []


def test_a_registry_row_the_readme_lacks_is_found():
    readme = readme_rows(README.read_text(encoding="utf-8"))
    rows = registry.table_rows()
    before = set(disagreements(readme, rows))
    changed = replace(registry.TIMM.models[1], readout="another readout")
    edited = [changed.row() if r == registry.TIMM.models[1].row() else r for r in rows]
    assert set(disagreements(readme, edited)) - before == {f"README only: {registry.TIMM.models[1].row()}",
                                                           f"registry only: {changed.row()}"}
    fewer = [r.replace("ALBERT (one layer shared by all), ", "") for r in rows]
    assert set(disagreements(readme, fewer)) - before == {"refused, README only: ALBERT (one layer shared by all)"}


def test_families_and_block_kinds_are_tried_in_this_order():
    """The order the dispatch and the layer anatomy have always used (a family added later may go anywhere;
    these keep their order among themselves)."""
    families = ["sentence-transformers", "swin", "transformers", "cait", "timm", "torch"]
    assert [f.name for f in registry.FAMILIES if f.name in families] == families
    kinds = ["data2vec-vision", "beit", "wav2vec2", "t5", "bart", "clip", "bert", "distilbert", "vit", "gpt2", "llama",
             "timm-eva", "timm", "torch"]
    assert [k.name for k in registry.block_kinds() if k.name in kinds] == kinds


def test_a_model_two_families_detect_gets_the_first_one_s_adapter_and_the_next_one_s_facts():
    """A transformers Swin is both transformers and Swin: Swin (earlier) captures it; Swin has no facts of
    its own, so model_facts gives the transformers ones."""
    T = pytest.importorskip("transformers")
    swin = T.SwinForImageClassification(T.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2],
                                                     num_heads=[2, 2], window_size=4, num_labels=3))
    assert registry.TRANSFORMERS.detect(swin) and registry.SWIN.detect(swin)
    assert type(_select_adapter(swin, None, None)).__name__ == "SwinHFAdapter"
    assert model_facts(swin, anatomy=False).family == "hf:swin"
    vit = T.ViTModel(T.ViTConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                                 image_size=8, patch_size=4))
    assert type(_select_adapter(vit, None, None)).__name__ == "HFAdapter"


def test_a_torch_model_and_an_unknown_one():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, batch_first=True), 2)
    assert type(_select_adapter(enc, None, None)).__name__ == "MHAAdapter"
    facts = model_facts(enc)
    assert facts.anatomy.family == "torch" and facts.anatomy.value_aware == registry.TORCH.blocks[0].refused
    with pytest.raises(attnroll.UnsupportedModelError) as e:
        attnroll.capture(nn.Linear(3, 3), torch.zeros(1, 3))
    for family in registry.FAMILIES:
        assert family.supported in str(e.value)


def test_the_texts_come_from_the_registry():
    assert hooks.supported_families() == hooks.SUPPORTED_FAMILIES == attnroll.capture.SUPPORTED_FAMILIES
    assert attnroll.capture.SUPPORTED_FAMILIES == registry.SUPPORTED_FAMILIES
    for kind in registry.block_kinds():
        assert kind.label in anatomy.KNOWN_FAMILIES and kind.parts in anatomy._LOOKED_FOR_PARTS
        assert kind.value_aware in anatomy.VALUE_AWARE_FAMILIES
    names = [k.name for k in registry.block_kinds()]
    assert len(names) == len(set(names))


def test_an_entry_must_list_known_method_groups_and_value_aware_with_its_block_kinds():
    with pytest.raises(ValueError, match="methods must be some of"):
        replace(registry.TORCH, methods=("attention", "rollout"))
    with pytest.raises(ValueError, match="'value-aware' is listed exactly when"):
        replace(registry.TORCH, methods=("attention", "value-aware"))
    with pytest.raises(ValueError, match="'value-aware' is listed exactly when"):
        replace(registry.TIMM, methods=("attention",))
