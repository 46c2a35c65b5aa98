from p2ptrain.cli import main

main()
