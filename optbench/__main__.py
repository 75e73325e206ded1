from optbench.cli import main

main()
