module strata/agent

go 1.19
