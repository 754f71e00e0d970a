"""Export: heads written in another layout (native | medusa_v1 | vllm), each loadable by its engine."""
