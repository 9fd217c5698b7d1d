fn main() -> std::process::ExitCode {
    diffmon::cli::main()
}
