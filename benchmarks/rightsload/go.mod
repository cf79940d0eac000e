module neonvm/rightsload

go 1.26
