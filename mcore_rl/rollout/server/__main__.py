from mcore_rl.rollout.server.app import main

main()
