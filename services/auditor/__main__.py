from services.auditor.service import main

main()
