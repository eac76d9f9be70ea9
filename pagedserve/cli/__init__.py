"""The entry points: the `pagedserve` command (`main`) and what only it uses, above the
services it starts and the shared layer beside this package (`.importlinter` says so).

* `main`: the parser and a function per subcommand, each importing its service when run;
* `cluster`: `pagedserve up`, the whole local cluster as child processes (`devices` maps
  their GPUs);
* `client`: `pagedserve generate` and `stats`, a gRPC client of the control plane;
* `model_source`: what `--model` names, resolved to a checkpoint (the default model, GGUF
  conversion, `model init`);
* `bench`: `pagedserve bench serve`, the load generator.

`python -m pagedserve.cli` runs the command as the console script does.
"""
