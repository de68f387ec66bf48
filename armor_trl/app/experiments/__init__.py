"""Experiments on the tiny offline setting: the demo (:mod:`.demo`) and the study of arms × seeds (:mod:`.study`),
with one runner (:mod:`.runner`) and the statistics (:mod:`.stats`). They build trainers through
:mod:`armor_trl.app.recipe`, as the command line does."""
