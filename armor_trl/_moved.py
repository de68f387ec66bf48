"""The import paths of the flat layout before 0.2 (``armor_trl.mixture``, ``armor_trl.trl_seam``, ``armor_trl.cli``, ...)
keep working: each names the module in its new folder (the same module object, so a patch through either name reaches
it), with a DeprecationWarning that gives the new path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import warnings

MOVED = {
    "mixture": "algorithm.mixture", "advantages": "algorithm.advantages", "loss_rows": "algorithm.loss_rows",
    "anchor_rollout": "rollout.anchor_rollout", "anchor_waves": "rollout.anchor_waves", "anchors": "rollout.anchors",
    "column_anchors": "rollout.column_anchors", "dynamic_sampling": "rollout.dynamic_sampling",
    "refill": "rollout.refill", "rollout_func": "rollout.rollout_func", "multimodal": "rollout.multimodal",
    "vllm_swap": "reference.vllm_swap", "vllm_reference": "reference.vllm_server",
    "trl_seam": "integration.trl_seam", "checkpoint": "integration.checkpoint", "checks": "integration.checks",
    "launcher": "integration.launcher", "armor_metrics": "integration.metrics",
    "reward_checks": "rewards.checks", "modes": "rewards.modes",
    "datasets": "data.datasets", "pregenerate": "data.pregenerate",
    "evaluation": "callbacks.evaluation", "collapse_guard": "callbacks.collapse_guard",
    "cli": "app.cli", "recipe": "app.recipe", "real_model": "app.real_model", "tiny": "app.tiny",
    "experiments": "app.experiments",
}
# names a flat-layout module held that live elsewhere now: old module -> {name: the module (new path) that holds it}
MOVED_NAMES = {
    "evaluation": {"ValidationCallback": "callbacks.validation", "TRAIN_REWARD_KEYS": "callbacks.validation"},
}


def _moved_names_getattr(package: str, module, names: dict):
    """A module ``__getattr__`` for ``module`` that reaches ``names`` in their new modules, with a DeprecationWarning."""
    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        new = f"{package}.{names[name]}"
        warnings.warn(f"{name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds ``armor_trl.<old name>`` (and what lies under a moved package, e.g. ``armor_trl.experiments.study``).

    The old name becomes an alias of the module imported under its new name: the module keeps its own ``__spec__``
    (importlib sets the old spec on a module a loader creates; :meth:`exec_module` puts the module's back), so importlib
    finds, reloads and treats it as a package under its own name. An old name's spec is a package where the new one is,
    and its code is the new module's (``python -m armor_trl.cli`` runs ``armor_trl.app.cli``)."""

    def __init__(self, package: str):
        self.package = package

    def new_name(self, fullname: str) -> str | None:
        prefix = self.package + "."
        if not fullname.startswith(prefix):
            return None
        head, _, rest = fullname[len(prefix):].partition(".")
        if head not in MOVED:
            return None
        return prefix + MOVED[head] + (f".{rest}" if rest else "")

    def new_spec(self, fullname: str):
        new = self.new_name(fullname)
        return None if new is None else importlib.util.find_spec(new)

    def find_spec(self, fullname, path=None, target=None):
        new_spec = self.new_spec(fullname)
        if new_spec is None:
            return None
        is_package = new_spec.submodule_search_locations is not None
        spec = importlib.util.spec_from_loader(fullname, self, origin=new_spec.origin, is_package=is_package)
        if is_package:
            spec.submodule_search_locations = list(new_spec.submodule_search_locations)
        return spec

    def create_module(self, spec):
        new = self.new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        names = MOVED_NAMES.get(spec.name[len(self.package) + 1:])
        if names and "__getattr__" not in vars(module):  # the old path's names that went elsewhere still resolve
            module.__getattr__ = _moved_names_getattr(self.package, module, names)
        spec.loader_state = module.__spec__  # importlib sets ``spec`` on the module next: exec_module restores it
        return module

    def exec_module(self, module):
        """The module was executed under its new name: it gets its own spec back."""
        module.__spec__ = module.__spec__.loader_state

    def is_package(self, fullname: str) -> bool:
        return self.new_spec(fullname).submodule_search_locations is not None

    def get_code(self, fullname: str):
        """The new module's code (what ``python -m`` runs)."""
        new_spec = self.new_spec(fullname)
        return new_spec.loader.get_code(new_spec.name)

    def get_source(self, fullname: str):
        new_spec = self.new_spec(fullname)
        return new_spec.loader.get_source(new_spec.name)
