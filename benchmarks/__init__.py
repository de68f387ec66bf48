"""Step time, time split and peak memory of ArmorGRPOTrainer vs trl.GRPOTrainer on one machine, in one run.

Every variant (``bench.yaml``) trains the same tiny model on the same data, reward and seed, with
G = num_generations and K = anchor_num_samples; ratios are taken against TRL's GRPOTrainer with beta = 0.04 (full
fine-tuning and LoRA), paired by repetition.

Modules: ``config`` (reads ``bench.yaml``: variants, baselines, targets, presets, defaults), ``workload`` (task,
reward, tiny model, pre-generated anchors, one trainer per variant), ``instruments`` (phase timers and peak RSS),
``run`` (one measured run in a worker process), ``whatif`` (generation layouts measured after training),
``summary`` (medians, paired ratios, targets), ``report`` (bench.md tables, bench.json), ``cli`` (arguments and the
schedule).

Usage: ``python -m benchmarks`` (``make bench``, a few minutes on 2 cores); ``--smoke`` for a seconds-long
structural run; ``--preset memory`` for peak RSS with a 19M-parameter model (weights visible above the runtime's
~320 MB); ``--configs grpo_b004,armor_cache`` runs a subset; ``--from-json bench.json`` renders the tables again.
Writes ``<out>/bench.json`` (settings, per-run per-step raw timings, summary, targets) and ``<out>/bench.md``
(the printed tables), default ``results/bench``; worker logs go to ``<out>/logs``.
"""
