from grpokit.cli.main import main

main()
