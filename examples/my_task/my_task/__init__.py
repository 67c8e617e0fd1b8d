"""An example task of your own for mcore-rl: a data kind, a reward function and an environment, in a package
that mcore-rl never imports by itself. `plugins=[my_task.data,my_task.envs]` on the command line (or
MCORE_RL_PLUGINS=my_task.data,my_task.envs in the environment) makes every process of a run import them; the yaml
files under conf/ reach Hydra through `hydra.searchpath=[file://<this folder>/conf]`. See docs/your_task.md."""
