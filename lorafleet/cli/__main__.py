from lorafleet.cli.main import main

main()
