"""CoServe's dependency-aware adapter switching and scheduling policies (CoServe, ASPLOS '25, §4),
as pure functions over statistics, with the baselines they are measured against.

- `graph`: what must be resident together (dependency graph, stranded successors);
- `usage`: usage probabilities (profile, declared, observed-rate fallback) and their composition
  along dependencies;
- `eviction`: two-stage eviction (§4.3), LRU and FIFO behind one interface;
- `preload`: the initial loading by usage probability (§4.1) carried on while the server runs;
- `arranging`: request arranging in the scheduling window (§4.2), FCFS;
- `assigning`: request assigning across DP ranks with `K * n + B` and switch latency (§4.2),
  least-loaded ("parallel");
- `profile`: the offline profile (§4.5) and the memory split it carries, with JSON forms;
- `fitting`: the line fit and max-batch plateau of the offline phase;
- `memory_split`: the decay-window search and the memory split (§4.4).

The core library only: torch/numpy/stdlib, never Ray, hmm, imm or coordinator. The engine calls
these between steps (`elasticmoe.engine.lora_swapper`, `elasticmoe.engine.scheduler`); the
profiler that measures a `Profile` is `elasticmoe.bench.adapter_profile`.
"""
