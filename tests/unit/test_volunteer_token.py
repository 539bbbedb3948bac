"""Issue 32, hole 2: a volunteer's box (owner: volunteer, the default for reach: tunnel) gets no
operator secret. The weights step (tasks/weights.py, its own code, run on each box's real host
data from load_inventory; pyinfra's operations recorded, not run: no host here) uploads the
Hugging Face token to operator-owned boxes only and removes one an earlier deploy left on a
volunteer's; a gated model routed to a volunteer's box is refused by the inventory in one
line naming the file, the host and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.context import ctx_host

from donorkit.box.serving import hf_token_path
from donorkit.inventory.fleet import FleetError, load_inventory
from tests.unit.test_tunnel import donors_file

SECRET = "hf_0perat0rS3cretT0ken"


def inventory(tmp_path: Path, change=None):
    """The testbed's home-donor fleet (tb-home, tb-never: reach tunnel) plus a direct donor, with
    the operator's token configured and an https hub (a token never goes to a plain one)."""
    token = tmp_path / "hf-token"
    token.write_text(SECRET + "\n")

    def edit(doc):
        doc["overrides"].update(hf_endpoint="https://huggingface.co",
                                hf_endpoint_plain_http_test_standin=False,
                                hf_token_file=str(token))
        doc["donors"]["tb-direct"] = {"ssh_host": "10.213.0.40", "ssh_user": "root",
                                      "card": "rtx4090",
                                      "routes": {"hermes.ai.unturf.com": "qwen"}}
        if change:
            change(doc)
    return load_inventory(donors_file(tmp_path, edit))


def weights_step(box, monkeypatch) -> list[tuple[str, dict]]:
    """The operations tasks/weights.py asks for on `box` (name, arguments), in order."""
    import tasks.weights as weights

    calls: list[tuple[str, dict]] = []
    for op in ("config_file", "absent_path", "directories", "model_weights"):
        monkeypatch.setattr(weights, op, lambda _op=op, **kw: calls.append((_op, kw)))

    class Host:  # pyinfra's host object, as the task reads it: its name and its data
        name = box.donor_name
        data = box

    with ctx_host.use(Host()):
        weights.apply._inner()
    return calls


def test_a_volunteers_box_gets_no_token_and_loses_an_old_one(tmp_path, monkeypatch) -> None:
    fleet, _ = inventory(tmp_path)
    home = fleet["tb-home"]
    assert (home.owner, home.hf_token_file) == ("volunteer", None)
    calls = weights_step(home, monkeypatch)
    assert SECRET not in repr(calls)
    assert not [kw for op, kw in calls if op == "config_file" and "token" in kw["dest"]]
    # A token an earlier version uploaded is removed (the run converges to none).
    assert ("absent_path", {"name": "No Hugging Face token (none in the inventory, or a "
                                    "volunteer's box)", "path": hf_token_path(home.install_root)}
            ) in calls
    [fetch] = [kw for op, kw in calls if op == "model_weights"]
    assert fetch["token_file"] is None and fetch["token_error"] is None


@pytest.mark.parametrize("owner_set", [False, True])
def test_operator_owned_boxes_still_get_it(tmp_path, monkeypatch, owner_set: bool) -> None:
    """A direct donor (operator by default) and a tunnelled box the operator says it controls
    (owner: operator, set explicitly) get the token, root's, 0600."""
    def change(doc):
        if owner_set:
            doc["donors"]["tb-home"]["owner"] = "operator"
    fleet, _ = inventory(tmp_path, change)
    box = fleet["tb-home" if owner_set else "tb-direct"]
    assert box.owner == "operator"
    calls = weights_step(box, monkeypatch)
    [upload] = [kw for op, kw in calls if op == "config_file" and kw["dest"].endswith("hf-token")]
    assert upload["content"].strip() == SECRET and upload["mode"] == "600" and upload["secret"]
    assert upload["dest"] == hf_token_path(box.install_root)
    [fetch] = [kw for op, kw in calls if op == "model_weights"]
    assert fetch["token_file"] == hf_token_path(box.install_root)


def test_a_gated_model_on_a_volunteers_box_is_refused_in_one_line(tmp_path) -> None:
    def gated(doc):
        doc["overrides"]["models"]["qwen"]["gated"] = True
    with pytest.raises(FleetError) as caught:
        inventory(tmp_path, gated)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        f"{tmp_path / 'donors.yml'}: donor 'tb-home': field 'routes.hermes.ai.unturf.com': "
        "model 'qwen' is gated (models.qwen.gated) and this box is a volunteer's (owner: "
        "volunteer): it gets no Hugging Face token; route an ungated model here, or set owner: "
        "operator if the operator controls it")

    def all_operators(doc):  # the same model on boxes the operator controls: accepted
        gated(doc)
        for name in ("tb-home", "tb-never"):
            doc["donors"][name]["owner"] = "operator"
    fleet, _ = inventory(tmp_path, all_operators)
    assert fleet["tb-home"].models["qwen"].gated and fleet["tb-home"].hf_token_file
