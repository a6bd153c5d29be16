"""DeepSpeed's JIT ops: built in the job's parent before it measures anything (`build`), the locks a killed build
left in the torch extensions cache (`locks`), and the link that lets their builds find torch's libraries
(`torch_lib`)."""
