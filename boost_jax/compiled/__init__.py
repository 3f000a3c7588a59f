"""Train steps compiled, and what is read off the programs: for a mesh of (simulated) devices
(:mod:`.step_report`: every collective against the analytic formula, memory, cost), for a
GPU cluster from a host without one (:mod:`.gpu_report`), and the planner checked against
both (:mod:`.plan_verify`). The ``comm_report`` and ``gpu_compile`` commands
(boost_jax/tools/) print these reports. This layer sits above ``train`` (it compiles its
step) and ``analysis`` (the formulas)."""
