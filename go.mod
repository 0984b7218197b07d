module github.com/bgtask/bgtask

go 1.24

require (
	github.com/google/uuid v1.3.0
	github.com/stretchr/testify v1.8.4
	go.uber.org/goleak v1.3.0
)

require (
	github.com/davecgh/go-spew v1.1.1 // indirect
	github.com/kr/text v0.2.0 // indirect
	github.com/pmezard/go-difflib v1.0.0 // indirect
	gopkg.in/yaml.v3 v3.0.1 // indirect
)
