"""The test-model factory, apart from the product: tiny pairs, fixture variants, converters, training."""
