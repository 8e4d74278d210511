from preemptible.cli._main import main

main()
