from mcore_rl.rollout.server.cli import main

main()
