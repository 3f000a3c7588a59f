from boost_jax.train.main import run_app

run_app()
