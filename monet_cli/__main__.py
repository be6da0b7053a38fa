from monet_cli.cli.app import main

main()
