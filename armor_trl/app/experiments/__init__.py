"""Experiments on the tiny offline setting: the demo (:mod:`.demo`) and the study of arms × seeds (:mod:`.study`),
with one runner (:mod:`.runner`), the statistics (:mod:`.stats`), the study's summary (:mod:`.summary`) and its
plots (:mod:`.plots`). They build trainers through :mod:`armor_trl.app.recipe`, as the command line does."""
