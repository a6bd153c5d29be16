"""DeepSpeed's JIT ops: built in the job's parent before it measures anything (`build`), the locks a killed build
left in the torch extensions cache (`locks`), the link that lets their builds find torch's libraries
(`torch_lib`), and py-cpuinfo's answer their builders ask for, kept per CPU (`cpu_info`).

Run telemetry: memory peaks, step timing, environment, plots."""
