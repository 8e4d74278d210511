from preemptible.cli import main

main()
