import trl
from packaging.version import Version
from packaging.specifiers import SpecifierSet

from armor_trl import trl_seam


def test_installed_trl_is_a_supported_version():
    assert Version(trl.__version__) in SpecifierSet(trl_seam.SUPPORTED_TRL)


def test_private_surface_we_rely_on_still_exists():
    assert trl_seam.check_trl_surface() == []


def test_surface_check_detects_a_missing_method(monkeypatch):
    monkeypatch.delattr(trl.GRPOTrainer, "_generate_single_turn")
    assert any("_generate_single_turn" in p for p in trl_seam.check_trl_surface())


def test_private_attributes_we_touch_exist_on_a_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    from testing import make_trainer

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)
    missing = [name for name in trl_seam.ATTRIBUTES if not hasattr(trainer, name)]
    assert missing == []
