from v100plan.cli import main

main()
